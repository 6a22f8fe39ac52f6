"""Measure this machine as a `HardwareProfile` (``freetoken simulate --profile-here``).

Each figure, and how it is measured (rates decimal GB/s = 1e9 bytes/s, sizes bytes):

- host_mem_gbps: memory read bandwidth the way decode uses it: a one-token matmul,
  ``F.linear([1, K], [N, K])`` of fp32 weights (K = `matmul_k`, default 4096; 4 weights of 64 MiB
  cycling, 256 MiB in all, beyond the caches; quick: 2 of 16 MiB), the weight's bytes / seconds of
  each product fed to a `BandwidthOracle` (its outlier-robust median), on torch's threads. This is
  what reading a routed expert's or a dense layer's weights for one token costs (a copy runs at
  another rate). The rate depends on the row length on CPUs: on the 2-core dev machine (AMD
  EPYC, 2 threads) K = 512 read ~10 GB/s, 1024 ~14, 4096 ~19; measure with the hidden size of the
  model to be simulated (`matmul_k`) where it is small.
- host_int8_gbps, host_mxfp4_gbps: the same one-token product through the engine's own
  `int8_linear` (int8 weights, fp32 row scales) and `mxfp4_linear` (E2M1 blocks, E8M0 scales) on
  the CPU under inference mode, the codec's bytes / seconds, each weight shaped as an expert's
  gate/up projection ([4K, K]: a kernel's fixed cost per call counts as in an expert), cycled past
  the caches as the fp32 weights. Where a kernel does more than read its weights (the int8 one
  dequantizes in registers, the MXFP4 path decodes a block of rows at a time before each block's
  matmul) this is below host_mem_gbps: on the 2-core Xeon dev machine at K = 512 int8 reads ~12
  GB/s where fp32 reads ~27, MXFP4 ~1.0 (~1.0 at K = 4096 too; 0.25 there when it decoded the
  whole weight; the CPU has no fused MXFP4 kernel yet).
- link_gbps of a "cpu" profile (a copy within RAM: a decode or a copy into tier 1): repeated copies
  of a large buffer (256 MiB; quick: 32 MiB) with ``Tensor.copy_``, into an oracle; a copy reads
  and writes its size, so it counts 2x its size of memory traffic (the STREAM "copy" convention).
- layer_overhead_us, expert_overhead_us, tier_overhead_us, miss_overhead_us,
  stream_overhead_us: the engine's own fixed costs, measured as `measure_overheads` says.
- disk_gbps: an FTW scratch file of expert-sized blocks (8 x 24 MiB; quick: 4 x 1 MiB), written
  with `FTWWriter` under `scratch_dir` (default: the temp dir), dropped from the page cache, read
  back block by block with the engine's `BlockReader` (O_DIRECT where the filesystem allows, else
  buffered + DONTNEED) whose per-read (bytes, seconds) go to an oracle; the file is deleted after.
  Pass a `scratch_dir` on the disk that will hold the models: on tmpfs this measures RAM.
- cpu_gflops: fp32 ``torch.mm`` of n x n matrices (n = 2048; quick: 512) on torch's current
  thread count, 2 n^3 flops per product, median of the repeats.
- cpu_cores: the CPUs this process may run on (``sched_getaffinity``, else ``os.cpu_count``).
- host_mem_bytes: physical pages x page size (``sysconf``).
- link_latency_us: median wall time of a tiny (4 KiB) copy: a memcpy on CPU; on CUDA a pinned
  host -> device copy plus the device sync (launch + sync, as the built-in profiles). >= 0.1 us.

With CUDA (device "cuda"): link_gbps from pinned host -> device copies timed with CUDA events
(`cuda_timed_copy`, counted once: the bytes cross the link once); device_mem_gbps from
device-to-device copies (counted 2x, as the host copy); device_mem_bytes the GPU's total memory;
device_bf16_tflops from a bf16 matmul (n = 8192; quick: 2048); device_lowp_tflops = 2 x bf16, an
estimate (the usual fp8/int8 tensor-core ratio), not a measurement.
Without CUDA (device "cpu") the device IS the host (see `profiles`): device memory figures are the
host's, link_gbps the copy bandwidth and device_*_tflops are cpu_gflops / 1000. With CUDA the
overheads are the host's (the CPU figures above), not the GPU's launches.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..ftw import FTWFile, FTWWriter
from ..ftw.codecs import encode
from ..memory.oracle import BandwidthOracle, cuda_timed_copy
from ..memory.storage import BlockReader
from .measure_overheads import _check_tiered_shape, _overheads_us, _tiered_overheads_us, median_seconds
from .profiles import HardwareProfile

__all__ = ["measure_profile", "median_seconds"]

logger = logging.getLogger(__name__)

MiB = 1024**2


@dataclass(frozen=True)
class _Sizes:
    copy_bytes: int
    read_weights: int  # one-token matmul weights cycled (each `read_bytes`)
    read_bytes: int
    overhead_reps: int
    reps: int
    block_bytes: int
    blocks: int
    cpu_n: int
    gpu_n: int


_FULL = _Sizes(
    copy_bytes=256 * MiB,
    read_weights=4,
    read_bytes=64 * MiB,
    overhead_reps=400,
    reps=10,
    block_bytes=24 * MiB,
    blocks=8,
    cpu_n=2048,
    gpu_n=8192,
)
_QUICK = _Sizes(
    copy_bytes=32 * MiB,
    read_weights=2,
    read_bytes=16 * MiB,
    overhead_reps=100,
    reps=3,
    block_bytes=1 * MiB,
    blocks=4,
    cpu_n=512,
    gpu_n=2048,
)


def measure_profile(
    name: str = "this-machine",
    *,
    quick: bool = False,
    scratch_dir: str | os.PathLike[str] | None = None,
    matmul_k: int = 4096,
    moe_experts: int = 8,
    moe_top_k: int = 2,
    moe_hidden: int = 64,
    moe_intermediate: int = 64,
) -> HardwareProfile:
    """Measure this machine (see the module docstring); `quick` uses small sizes (seconds).
    `matmul_k`: the row length K of the one-token matmul host_mem_gbps is read with;
    `moe_experts`, `moe_top_k`: the MoE layer shape the tiered overheads are measured with (a
    model's own: pre-gating ranks a layer's experts, and a layer routes top-k; at least 2 x top-k
    experts), and `moe_hidden`, `moe_intermediate` its experts' shape (default tiny: what the
    CPU's Python costs beside a GPU; a CPU-only model's own shape measures it between the expert
    matmuls that share its caches, as `bench/simulate_validate.py` does). ValueError, before
    anything is measured, for a MoE shape it cannot measure."""
    _check_tiered_shape(moe_experts, moe_top_k, moe_hidden, moe_intermediate)  # before any measuring
    sz = _QUICK if quick else _FULL
    host_gbps = _read_gbps(sz, matmul_k)
    logger.info("host memory: %.1f GB/s (one-token matmul reads)", host_gbps)
    int8_gbps, mxfp4_gbps = _codec_read_gbps(sz, matmul_k)
    logger.info("cpu kernels: int8 %.1f GB/s, mxfp4 %.1f GB/s (one token)", int8_gbps, mxfp4_gbps)
    copy_gbps = _copy_gbps(sz)
    logger.info("host copy: %.1f GB/s (2x bytes)", copy_gbps)
    layer_us, expert_us = _overheads_us(
        sz.overhead_reps, host_gbps, scratch_dir, hidden=moe_hidden, intermediate=moe_intermediate
    )
    tier_us, miss_us, stream_us = _tiered_overheads_us(
        sz.overhead_reps,
        scratch_dir,
        experts=moe_experts,
        top_k=moe_top_k,
        hidden=moe_hidden,
        intermediate=moe_intermediate,
    )
    logger.info(
        "overheads (us): %.1f per layer, %.1f per expert, %.1f per tiered layer, %.1f per tier-1 miss"
        " (+%.1f a STREAM)",
        layer_us,
        expert_us,
        tier_us,
        miss_us,
        stream_us,
    )
    disk_gbps = _disk_gbps(sz, scratch_dir)
    logger.info("disk: %.2f GB/s", disk_gbps)
    cpu_gflops = _cpu_gflops(sz.cpu_n, sz.reps)
    logger.info("cpu: %.1f GFLOP/s fp32 on %d threads", cpu_gflops, torch.get_num_threads())
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    host: dict[str, Any] = dict(host_mem_gbps=host_gbps, host_mem_bytes=host_bytes, disk_gbps=disk_gbps)
    host.update(cpu_gflops=cpu_gflops, cpu_cores=cores)
    host.update(layer_overhead_us=layer_us, expert_overhead_us=expert_us)
    host.update(tier_overhead_us=tier_us, miss_overhead_us=miss_us, stream_overhead_us=stream_us)
    host.update(host_int8_gbps=int8_gbps, host_mxfp4_gbps=mxfp4_gbps)
    if torch.cuda.is_available():
        return HardwareProfile(name=name, device="cuda", **_cuda_figures(sz), **host)
    small, dst = torch.ones(1024, dtype=torch.float32), torch.empty(1024, dtype=torch.float32)
    latency_us = median_seconds(lambda: dst.copy_(small), 200) * 1e6
    return HardwareProfile(
        name=name,
        device="cpu",
        link_gbps=copy_gbps,
        link_latency_us=max(latency_us, 0.1),
        device_mem_gbps=host_gbps,
        device_mem_bytes=host_bytes,
        device_bf16_tflops=cpu_gflops / 1000,
        device_lowp_tflops=cpu_gflops / 1000,
        **host,
    )


def _gbps(oracle: BandwidthOracle) -> float:
    bps = oracle.estimate()
    if not bps:
        raise RuntimeError(f"{oracle.name}: no timed transfer to measure")
    return bps / 1e9


def _copy_gbps(sz: _Sizes) -> float:
    src = torch.ones(sz.copy_bytes, dtype=torch.uint8)  # written once: every page is mapped
    dst = torch.zeros_like(src)
    dst.copy_(src)  # warm-up
    oracle = BandwidthOracle("host copy", clock=time.perf_counter)
    for _ in range(sz.reps):
        with oracle.time_transfer(2 * sz.copy_bytes):  # read + write
            dst.copy_(src)
    return _gbps(oracle)


def _read_gbps(sz: _Sizes, k: int) -> float:
    """Weight bytes / seconds of one-token fp32 matmuls [1, k] x [N, k] over weights cycled past
    the caches."""
    n = sz.read_bytes // (4 * k)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) for _ in range(sz.read_weights)]
    x = torch.randn(1, k, generator=g)
    oracle = BandwidthOracle("host memory", clock=time.perf_counter)
    with torch.no_grad():
        for w in weights:
            F.linear(x, w)  # warm-up
        for _ in range(sz.reps):
            for w in weights:
                with oracle.time_transfer(w.nbytes):
                    F.linear(x, w)
    return _gbps(oracle)


def _codec_read_gbps(sz: _Sizes, k: int) -> tuple[float, float]:
    """Weight bytes / seconds of one-token products through `int8_linear` and `mxfp4_linear` on
    the CPU, each weight shaped as an expert's gate/up projection of hidden `k`: [4k, k] (a kernel's
    fixed cost per call counts as it does in an expert), cycled over `read_weights` x `read_bytes`
    of int8 (MXFP4: a quarter of that) to read past the caches."""
    from ..kernels.int8 import int8_linear
    from ..kernels.mxfp4 import mxfp4_linear

    g = torch.Generator().manual_seed(0)
    k = max(32, k // 32 * 32)
    n = 4 * k
    count = max(2, sz.read_weights * sz.read_bytes // (n * k))  # past the caches, as the fp32 reads
    x = torch.randn(1, k, generator=g)
    int8 = [
        (torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g) / 64)
        for _ in range(count)
    ]
    mxfp4 = [
        (
            torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
            torch.randint(120, 131, (n, k // 32), dtype=torch.uint8, generator=g),
        )
        for _ in range(max(2, count // 4))  # decoded per call: a quarter of them is plenty
    ]
    rates = []
    for name, weights, linear in (("int8", int8, int8_linear), ("mxfp4", mxfp4, mxfp4_linear)):
        oracle = BandwidthOracle(f"cpu {name}", clock=time.perf_counter)
        with torch.inference_mode():  # as the engine runs them (the int8 kernel: ~1.8x grad mode's)
            for w, scale in weights:
                linear(x, w, scale)  # warm-up
            for _ in range(sz.reps):
                for w, scale in weights:
                    with oracle.time_transfer(w.nbytes + scale.nbytes):
                        linear(x, w, scale)
        rates.append(_gbps(oracle))
    return rates[0], rates[1]


def _disk_gbps(sz: _Sizes, scratch_dir: str | os.PathLike[str] | None) -> float:
    oracle = BandwidthOracle("storage->host", clock=time.perf_counter)
    data = torch.randn(sz.block_bytes // 4, generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory(prefix="freetoken-measure-", dir=scratch_dir) as tmp:
        path = Path(tmp) / "scratch.ftw"
        with FTWWriter(path, model_config={"model_type": "measure"}) as w:  # fsyncs on close
            for e in range(sz.blocks):
                w.add_expert(0, e, {"w": encode(data, "fp32")})
        del data
        fd = os.open(path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):  # what the writer left cached is not a disk read
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        with FTWFile(path) as ftw:
            reader = BlockReader(ftw, on_transfer=oracle.record)
            try:
                for key in ftw.expert_keys():
                    reader.read(*key)
                if not reader.direct:
                    logger.warning("%s: no O_DIRECT; disk figure may include the page cache", tmp)
            finally:
                reader.close()
    return _gbps(oracle)


def _cpu_gflops(n: int, reps: int) -> float:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    out = torch.empty(n, n)
    return 2 * n**3 / median_seconds(lambda: torch.mm(a, b, out=out), reps) / 1e9


def _cuda_figures(sz: _Sizes) -> dict[str, Any]:
    """The device figures of GPU 0 (see the module docstring)."""
    dev = torch.device("cuda", 0)
    src = torch.ones(sz.copy_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(sz.copy_bytes, dtype=torch.uint8, device=dev)
    link = BandwidthOracle("host->device", clock=time.perf_counter)
    stream = torch.cuda.Stream(dev)
    dst.copy_(src)  # warm-up
    for _ in range(sz.reps):
        cuda_timed_copy(link, dst, src, stream)
    torch.cuda.synchronize(dev)
    dev_mem = BandwidthOracle("device memory", clock=time.perf_counter)
    dst2 = torch.empty_like(dst)
    dst2.copy_(dst)  # warm-up
    for _ in range(sz.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst2.copy_(dst)
        end.record()
        end.synchronize()
        dev_mem.record(2 * sz.copy_bytes, start.elapsed_time(end) / 1e3)  # read + write
    small, small_dev = src[:4096], dst[:4096]

    def tiny_copy() -> None:
        small_dev.copy_(small, non_blocking=True)
        torch.cuda.synchronize(dev)

    latency_us = median_seconds(tiny_copy, 200) * 1e6
    n = sz.gpu_n
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    torch.mm(a, b)  # warm-up (cuBLAS handle, heuristics)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(sz.reps):
        torch.mm(a, b)
    end.record()
    end.synchronize()
    bf16_tflops = 2 * n**3 * sz.reps / (start.elapsed_time(end) / 1e3) / 1e12
    logger.info("cuda: link %.1f GB/s, bf16 %.1f TFLOP/s", _gbps(link), bf16_tflops)
    return dict(
        link_gbps=_gbps(link),
        link_latency_us=max(latency_us, 0.1),
        device_mem_gbps=_gbps(dev_mem),
        device_mem_bytes=torch.cuda.get_device_properties(dev).total_memory,
        device_bf16_tflops=bf16_tflops,
        device_lowp_tflops=2 * bf16_tflops,  # estimate: fp8/int8 tensor cores at 2x bf16
    )
