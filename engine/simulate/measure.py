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
- layer_overhead_us: the engine's own decode step of a random Mixtral (8 layers, 8 experts, top-2,
  of the MoE shape below: tiny, hidden 64, by default; written by transformers into `scratch_dir`
  and loaded as a user's checkpoint),
  median wall time less its weights' bytes at host_mem_gbps and its 16 routed experts (each at
  expert_overhead_us plus its bytes), per layer (>= 0.1 us): what a layer costs besides its
  weights (op launches, the Python around them), the token's own (final norm, lm_head, the step)
  shared out over its layers. A synthetic layer of the same ops measured half of it on the 2-core
  Xeon dev machine (83 us against the engine's ~170): the engine's layer has more Python.
- expert_overhead_us: one routed expert of that shape (`moe_hidden` x `moe_intermediate`), fp32,
  on one token through
  the engine's `expert_forward` plus the weighted accumulate (``add_``) the decode loop runs,
  median wall time less its bytes at host_mem_gbps (>= 0.1 us).
- tier_overhead_us: the engine's `TieredExpertProvider` over a scratch FTW file of experts
  (8 MoE layers x `moe_experts` experts (default 8), fp32, `moe_hidden` x `moe_intermediate`,
  default a tiny 64 x 64) with routers for
  pre-gating, tier 1 one expert short of all of them and holding the top-k (`moe_top_k`, default
  2) each step routes to (pre-gating and prefetch run, as whenever tier 1 cannot hold the model),
  in inference mode as the engine's decode step: its median time per MoE layer less the same
  steps with tier 1 holding every expert (no pre-gating then): the bookkeeping and pre-gating a
  tiered step pays per layer besides moving and computing experts. It grows with the experts a
  layer has (~25 us at 8, ~37 at 128 on the 2-core Xeon dev machine, one thread).
- miss_overhead_us: the same provider without prefetch, tier 1 room for one layer's top-k and
  every step routed to top-k experts tier 1 does not hold (0-1, then 2-3, ... for top-2), each
  priced by q* and then computed where its weights are (HOST): its time per MoE layer less the
  same steps with every expert in tier 1, per miss: q*'s decision and the Python around a HOST
  computation.
- stream_overhead_us: the same steps with q*'s own choice, a STREAM for these zero-copy fp32
  blocks, per miss, less miss_overhead_us: the promotion (a view of the stored bytes), the
  eviction it causes and the demotion of the evicted block into tier 2.
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
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from ..ftw import FTWFile, FTWWriter
from ..ftw.codecs import encode
from ..memory.oracle import BandwidthOracle, cuda_timed_copy
from ..memory.storage import BlockReader
from .profiles import HardwareProfile

__all__ = ["measure_profile"]

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


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of `reps` calls of `fn`, after one untimed warm-up call."""
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


def _overheads_us(
    reps: int,
    host_gbps: float,
    scratch_dir: str | os.PathLike[str] | None,
    hidden: int = 64,
    intermediate: int = 64,
) -> tuple[float, float]:
    """(per layer, per expert) fixed costs in microseconds (module docstring): one routed expert
    of `hidden` x `intermediate` through `expert_forward` and its accumulate, and the engine's own
    decode step of a random Mixtral of that hidden size and those experts, each less its weights'
    bytes at `host_gbps`."""
    from ..model.routed import expert_forward
    from ..spec import MoESpec

    h, n_exp, inter = hidden, 8, intermediate
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, h, generator=g)
    spec = MoESpec(num_experts=n_exp, top_k=2, intermediate_size=inter, routing="softmax_topk")
    expert = SimpleNamespace(
        gate_up=torch.randn(2 * inter, h, generator=g) * 0.1, down=torch.randn(h, inter, generator=g) * 0.1,
        gate_up_bias=None, down_bias=None, gate_up_scale=None, down_scale=None,
    )  # fmt: skip
    acc = torch.zeros_like(x)

    def one_expert() -> None:
        acc.add_(expert_forward(expert, x, spec), alpha=0.5)

    bps = host_gbps * 1e9
    with torch.inference_mode():
        expert_s = max(median_seconds(one_expert, reps) - 4 * 3 * h * inter / bps, 0.1e-6)
    layer_s = _engine_layer_s(reps, bps, expert_s, scratch_dir, hidden=h, intermediate=inter)
    # Floored in microseconds: 0.1e-6 s x 1e6 is 0.0999..., under the floor it stands for.
    return max(layer_s * 1e6, 0.1), max(expert_s * 1e6, 0.1)


def _engine_layer_s(
    reps: int,
    bps: float,
    expert_s: float,
    scratch_dir: str | os.PathLike[str] | None,
    hidden: int = 64,
    intermediate: int = 64,
) -> float:
    """Seconds a decoder layer of the engine costs in a decode step besides its weights and its
    routed experts: decode steps of a random Mixtral (8 layers, 8 experts, top-2, `hidden` wide
    with experts of `intermediate`, heads of 64 or 4 heads if more; written by transformers,
    loaded by the engine as a user's checkpoint is), less the weights' bytes at `bps` and the two
    experts per layer at `expert_s` plus their bytes, per layer. The token's own costs (final
    norm, lm_head, the step's Python) are shared out over its layers, as the machine model has no
    term of its own for them."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    from ..engine import Engine

    layers, h, inter, vocab = 8, hidden, intermediate, 256
    cfg = MixtralConfig(
        vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=max(4, h // 64), num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=4 * reps + 64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a scratch model: no "Writing model shards" bar
    try:
        with tempfile.TemporaryDirectory(prefix="freetoken-measure-", dir=scratch_dir) as tmp:
            MixtralForCausalLM(cfg).save_pretrained(tmp)
            engine = Engine.from_pretrained(tmp, device="cpu", dtype=torch.float32, placement="resident")
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    dense = sum(p.numel() for p in engine.model.parameters()) * 4 - vocab * h * 4 + h * 4  # one embedding row
    expert_bytes = 4 * 3 * h * inter
    with engine.new_session() as session:
        session.prefill([1, 2, 3, 4])
        tokens = iter(range(10**9))
        step_s = median_seconds(lambda: session.decode(5 + next(tokens) % (vocab - 5)), reps)
    engine.close()
    experts = layers * 2 * (expert_s + expert_bytes / bps)
    return (step_s - dense / bps - experts) / layers


def _check_tiered_shape(experts: int, top_k: int, hidden: int, intermediate: int, layers: int = 1) -> None:
    """ValueError, in one line, for a MoE layer shape `_tiered_overheads_us` cannot measure."""
    if not 1 <= top_k <= experts // 2:
        raise ValueError(f"measuring misses needs 2 x top_k <= experts, got top_k {top_k} of {experts}")
    if min(layers, hidden, intermediate) < 1:
        raise ValueError(
            f"layers, hidden and intermediate must be at least 1, got {layers}, {hidden}, {intermediate}"
        )


def _tiered_overheads_us(
    reps: int,
    scratch_dir: str | os.PathLike[str] | None,
    *,
    experts: int = 8,
    top_k: int = 2,
    layers: int = 8,
    hidden: int = 64,
    intermediate: int = 64,
) -> tuple[float, float, float]:
    """(per MoE layer, per miss, per STREAM on top) fixed costs of the tiered provider in
    microseconds (module docstring), on a scratch FTW file of `layers` MoE layers of `experts`
    experts, `top_k` routed per token (2 x top_k <= experts). Pass a model's experts
    and top-k to measure the costs that grow with them (pre-gating ranks a layer's experts; a
    layer routes top-k). With fewer layers than the pre-gating depth ahead of most of them, the
    last ones pre-gate less. `hidden`, `intermediate`: the experts' shape (fp32). Tiny ones leave
    the CPU's caches to the bookkeeping, as on a GPU machine whose device computes the experts;
    a CPU-only engine computes them between its Python, which then runs from colder caches (on
    the 2-core Xeon, one thread, 8 experts top-2, 7 layers: a miss 27 us at 64 x 64, 83 at
    512 x 1024)."""
    from ..memory import MemoryBudget, Placement, TieredExpertProvider
    from ..model.moe import Router
    from ..spec import MoESpec

    _check_tiered_shape(experts, top_k, hidden, intermediate, layers)
    h, inter = hidden, intermediate
    everything = layers * experts
    spec = MoESpec(num_experts=experts, top_k=top_k, intermediate_size=inter, routing="softmax_topk")
    g = torch.Generator().manual_seed(0)
    routers = {layer: Router(spec, h).to_empty(device="cpu") for layer in range(layers)}
    for router in routers.values():  # real weights: a router left on the meta device pre-gated
        torch.nn.init.normal_(router.weight, generator=g)  # through Python meta kernels (~15 us a layer)
    x = torch.randn(1, h, generator=g)
    routed = [torch.tensor([list(range(top_k))]), torch.tensor([list(range(top_k, 2 * top_k))])]
    weights = torch.full((1, top_k), 1.0 / top_k)
    with tempfile.TemporaryDirectory(prefix="freetoken-measure-", dir=scratch_dir) as tmp:
        path = Path(tmp) / "experts.ftw"
        with FTWWriter(path, model_config={"model_type": "measure"}) as w:
            for layer in range(layers):
                for e in range(experts):
                    gate_up, down = torch.randn(2 * inter, h, generator=g), torch.randn(h, inter, generator=g)
                    w.add_expert(layer, e, {"gate_up": encode(gate_up, "fp32"), "down": encode(down, "fp32")})
        probe = TieredExpertProvider(path, MemoryBudget(), top_k=top_k, prefetch=False)
        each = max(probe.fast_bytes.values())
        probe.close()

        def per_layer_s(
            in_tier1: int, *, prefetch: bool, alternate: bool, host: bool = False
        ) -> tuple[float, float]:
            """(seconds per MoE layer, the share of its misses q* streamed) with room for
            `in_tier1` experts, tier 1 holding them (or the routed ones), routed to the first top_k
            experts (and the next top_k every other step with `alternate`). `host`: q* prices
            every miss as usual, then computes it where its weights are (HOST) instead of what it
            chose (for these zero-copy blocks mostly a STREAM)."""
            budget = MemoryBudget(fast_bytes=in_tier1 * each)
            tp = TieredExpertProvider(
                path, budget, top_k=top_k, routers=routers, prefetch=prefetch, prefetch_thread=False
            )
            if host:
                priced = tp.policy.decide
                tp.policy.decide = lambda key, case: (priced(key, case), Placement.HOST)[1]  # type: ignore[method-assign]
            steps = [0]
            try:
                for layer in range(layers):
                    for e in range(experts if in_tier1 == everything else top_k):
                        tp.get(layer, e)

                def step() -> None:
                    ids = routed[steps[0] % 2] if alternate else routed[0]
                    steps[0] += 1
                    for layer in range(layers):
                        tp.run(layer, x, ids, weights, spec)

                # As the engine's decode step runs it (`Session`): in inference mode.
                with torch.inference_mode():
                    seconds = median_seconds(step, reps) / layers
                decided = tp.policy.decisions
                misses = sum(n for p, n in decided.items() if p != Placement.RESIDENT.value)
                return seconds, decided[Placement.STREAM.value] / misses if misses else 0.0
            finally:
                tp.close()

        resident, _ = per_layer_s(everything, prefetch=True, alternate=False)  # pre-gating skipped
        pregating, _ = per_layer_s(everything - 1, prefetch=True, alternate=False)
        all_hits, _ = per_layer_s(everything, prefetch=False, alternate=True)
        chosen, streamed = per_layer_s(top_k, prefetch=False, alternate=True)  # every routed expert misses
        computed, _ = per_layer_s(top_k, prefetch=False, alternate=True, host=True)
    miss = max((computed - all_hits) / top_k, 0.0)
    # q*'s own choices: mostly STREAMs (the first miss is computed HOST, to measure the host)
    stream = max((chosen - all_hits) / top_k - miss, 0.0) / streamed if streamed else 0.0
    return max((pregating - resident) * 1e6, 0.0), miss * 1e6, stream * 1e6


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
