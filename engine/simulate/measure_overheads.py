"""The engine's own fixed costs, measured on this machine (`measure.measure_profile`,
``freetoken simulate --profile-here``; `bench/simulate_overheads.py` for the tiered ones), in
microseconds:

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
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from ..ftw import FTWWriter
from ..ftw.codecs import encode

__all__ = ["median_seconds"]


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of `reps` calls of `fn`, after one untimed warm-up call."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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
