"""What a tiered MoE layer costs when every routed expert is already in tier 1 (the all-hit layer),
beyond the resident engine's layer (`bench/simulate_overheads.py`, issue 61).

`all_hit_overhead_us` builds a scratch FTW file of `layers` MoE layers of `experts` fp32 experts
(tiny by default: the CPU's Python is what is measured, as on a GPU machine whose device computes
the experts), a `TieredExpertProvider` with tier 1 holding every expert (pre-gating routers
attached; with everything in tier 1 the provider skips them) and the resident store
(`experts.InMemoryExpertProvider`) over the same weights. Both run the same decode steps (one
token, `top_k` distinct experts per layer, 16 routings cycled) in inference mode, in rounds that
alternate the two stores, so a machine whose load changes during the run slows both alike. The
figure is the median over rounds of (tiered - resident) per MoE layer: the tier's lookup of the
routed experts, the frequency and recency updates, the hot-set re-evaluation every `hot_every`
steps, counting and timing, never an expert's compute (both run the same kernels on the same
weights).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch

from ..ftw import FTWWriter
from ..ftw.codecs import encode
from ..model.experts import ExpertWeights, InMemoryExpertProvider
from .measure_overheads import median_seconds


def all_hit_overhead_us(
    reps: int,
    scratch_dir: str | Path | None = None,
    *,
    experts: int = 8,
    top_k: int = 2,
    layers: int = 8,
    hidden: int = 64,
    intermediate: int = 64,
    rounds: int = 5,
) -> tuple[float, float]:
    """(tiered all-hit layer less the resident layer, the resident layer) in microseconds per MoE
    layer, medians over `rounds` alternating rounds of `reps` decode steps each (module doc).
    ValueError for top_k outside 1..experts or a non-positive size."""
    from ..memory import MemoryBudget, TieredExpertProvider
    from ..model.moe import Router
    from ..spec import MoESpec

    if not 1 <= top_k <= experts or min(layers, hidden, intermediate, reps, rounds) < 1:
        raise ValueError(
            f"all-hit measure needs 1 <= top_k <= experts and positive sizes, got top_k {top_k} of "
            f"{experts}, layers {layers}, hidden {hidden}, intermediate {intermediate}"
        )
    spec = MoESpec(num_experts=experts, top_k=top_k, intermediate_size=intermediate, routing="softmax_topk")
    g = torch.Generator().manual_seed(0)
    routers = {layer: Router(spec, hidden).to_empty(device="cpu") for layer in range(layers)}
    for router in routers.values():
        torch.nn.init.normal_(router.weight, generator=g)
    x = torch.randn(1, hidden, generator=g)
    routings = [torch.randperm(experts, generator=g)[:top_k][None] for _ in range(16)]
    weights = torch.full((1, top_k), 1.0 / top_k)
    tensors: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    with tempfile.TemporaryDirectory(prefix="freetoken-measure-", dir=scratch_dir) as tmp:
        path = Path(tmp) / "experts.ftw"
        with FTWWriter(path, model_config={"model_type": "measure"}) as w:
            for layer in range(layers):
                for e in range(experts):
                    gate_up = torch.randn(2 * intermediate, hidden, generator=g)
                    down = torch.randn(hidden, intermediate, generator=g)
                    tensors[(layer, e)] = {"gate_up": gate_up, "down": down}
                    w.add_expert(layer, e, {"gate_up": encode(gate_up, "fp32"), "down": encode(down, "fp32")})
        resident = InMemoryExpertProvider(
            {k: ExpertWeights.packed(t, torch.float32, "cpu") for k, t in tensors.items()}
        )
        tiered = TieredExpertProvider(
            path, MemoryBudget(), top_k=top_k, routers=routers, prefetch=True, prefetch_thread=False
        )
        try:
            for key in tiered.keys():  # every expert into tier 1
                tiered.get(*key)
            stores = {"tiered": tiered, "resident": resident}
            steps = dict.fromkeys(stores, 0)

            def step(name: str) -> None:
                store, i = stores[name], steps[name]
                steps[name] = i + 1
                ids = routings[i % len(routings)]
                for layer in range(layers):
                    store.run(layer, x, ids, weights, spec)

            seconds: dict[str, list[float]] = {name: [] for name in stores}
            with torch.inference_mode():  # as the engine's decode step runs
                for r in range(rounds):
                    for name in list(stores)[r % 2 :] + list(stores)[: r % 2]:
                        seconds[name].append(median_seconds(lambda name=name: step(name), reps))
        finally:
            tiered.close()
    extra = statistics.median(t - r for t, r in zip(seconds["tiered"], seconds["resident"], strict=True))
    return extra / layers * 1e6, statistics.median(seconds["resident"]) / layers * 1e6
