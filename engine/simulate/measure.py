"""Measure this machine as a `HardwareProfile` (``freetoken simulate --profile-here``).

Each figure, and how it is measured (rates decimal GB/s = 1e9 bytes/s, sizes bytes):

- host_mem_gbps: repeated copies of a large buffer (256 MiB; quick: 32 MiB) with ``Tensor.copy_``
  on torch's threads, fed to a `BandwidthOracle` (its outlier-robust median). A copy reads and
  writes its size, so it counts 2x its size of memory traffic (the STREAM "copy" convention).
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
host's, link_gbps is host_mem_gbps and device_*_tflops are cpu_gflops / 1000.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..codecs import encode
from ..ftw import FTWFile, FTWWriter
from ..memory.oracle import BandwidthOracle, cuda_timed_copy
from ..memory.storage import BlockReader
from .profiles import HardwareProfile

__all__ = ["measure_profile"]

logger = logging.getLogger(__name__)

MiB = 1024**2


@dataclass(frozen=True)
class _Sizes:
    copy_bytes: int
    reps: int
    block_bytes: int
    blocks: int
    cpu_n: int
    gpu_n: int


_FULL = _Sizes(copy_bytes=256 * MiB, reps=10, block_bytes=24 * MiB, blocks=8, cpu_n=2048, gpu_n=8192)
_QUICK = _Sizes(copy_bytes=32 * MiB, reps=3, block_bytes=1 * MiB, blocks=4, cpu_n=512, gpu_n=2048)


def measure_profile(
    name: str = "this-machine", *, quick: bool = False, scratch_dir: str | os.PathLike[str] | None = None
) -> HardwareProfile:
    """Measure this machine (see the module docstring); `quick` uses small sizes (seconds)."""
    sz = _QUICK if quick else _FULL
    host_gbps = _host_mem_gbps(sz)
    logger.info("host memory: %.1f GB/s (copy, 2x bytes)", host_gbps)
    disk_gbps = _disk_gbps(sz, scratch_dir)
    logger.info("disk: %.2f GB/s", disk_gbps)
    cpu_gflops = _cpu_gflops(sz.cpu_n, sz.reps)
    logger.info("cpu: %.1f GFLOP/s fp32 on %d threads", cpu_gflops, torch.get_num_threads())
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    host: dict[str, Any] = dict(host_mem_gbps=host_gbps, host_mem_bytes=host_bytes, disk_gbps=disk_gbps)
    host.update(cpu_gflops=cpu_gflops, cpu_cores=cores)
    if torch.cuda.is_available():
        return HardwareProfile(name=name, device="cuda", **_cuda_figures(sz), **host)
    small, dst = torch.ones(1024, dtype=torch.float32), torch.empty(1024, dtype=torch.float32)
    latency_us = _median_seconds(lambda: dst.copy_(small), 200) * 1e6
    return HardwareProfile(
        name=name,
        device="cpu",
        link_gbps=host_gbps,
        link_latency_us=max(latency_us, 0.1),
        device_mem_gbps=host_gbps,
        device_mem_bytes=host_bytes,
        device_bf16_tflops=cpu_gflops / 1000,
        device_lowp_tflops=cpu_gflops / 1000,
        **host,
    )


def _median_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gbps(oracle: BandwidthOracle) -> float:
    bps = oracle.estimate()
    if not bps:
        raise RuntimeError(f"{oracle.name}: no timed transfer to measure")
    return bps / 1e9


def _host_mem_gbps(sz: _Sizes) -> float:
    src = torch.ones(sz.copy_bytes, dtype=torch.uint8)  # written once: every page is mapped
    dst = torch.zeros_like(src)
    dst.copy_(src)  # warm-up
    oracle = BandwidthOracle("host memory", clock=time.perf_counter)
    for _ in range(sz.reps):
        with oracle.time_transfer(2 * sz.copy_bytes):  # read + write
            dst.copy_(src)
    return _gbps(oracle)


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
    return 2 * n**3 / _median_seconds(lambda: torch.mm(a, b, out=out), reps) / 1e9


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

    latency_us = _median_seconds(tiny_copy, 200) * 1e6
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
