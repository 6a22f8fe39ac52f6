"""The engine's own bookkeeping, priced by default for the policies that run through its tiered
provider (qstar, qstar-profiled, layer-lru: `replay.TieredReplay`) (issue 62).

The tiered provider is Python: per MoE layer of a tiered step its bookkeeping and pre-gating
(`tier_overhead_us`), per routed expert outside tier 1 q*'s decision and the Python around
computing it where its weights are (`miss_overhead_us`), per STREAM the tier moves on top
(`stream_overhead_us`). llama.cpp's static split and the other baselines, C++ with nothing to
decide, pay none of it; a replay that left them at 0 predicted an engine whose bookkeeping is free.
So a profile that does not name them (the built-ins; a TOML file without the keys) is charged
`MEASURED`, the figures `python bench/simulate_overheads.py` measured on the engine's own MoE
layer of the model's shape (`costs_for`: the measured shape nearest the model's experts and
top-k). A profile's own figure, 0 included, replaces each (`priced`); `--profile-here` measures
them on the machine at hand.

The measurement ran on the 2-core Xeon dev machine, 2 torch threads: a server CPU core at ~2 GHz.
A desktop CPU of a GPU box runs this Python faster (`bench/simulate_overheads.py --scales`
replays smaller multiples); these are the engine's costs as measured, not as they could be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .profiles import HardwareProfile
from .shapes import ModelShape

__all__ = ["MEASURED", "MEASURED_BY", "EngineCosts", "costs_for", "priced"]


@dataclass(frozen=True)
class EngineCosts:
    """The tiered provider's fixed costs in microseconds, and where they come from."""

    tier_us: float  # per MoE layer of a tiered step
    miss_us: float  # per routed expert outside tier 1
    stream_us: float  # more per STREAM among them
    source: str

    def line(self) -> str:
        """One line for the simulator's output."""
        return (
            f"{self.tier_us:.1f} us a tiered MoE layer, {self.miss_us:.1f} us a tier-1 miss, "
            f"{self.stream_us:.1f} us more a STREAM ({self.source})"
        )


MEASURED_BY = (
    "python bench/simulate_overheads.py, 2-core Xeon dev machine, 2 threads, median of 3, 2026-12-07"
)
"""The command, machine and date of `MEASURED` (docs/benchmarks.md, "The provider's overheads
priced in", quotes the same run)."""
MEASURED: dict[tuple[int, int], EngineCosts] = {
    (8, 2): EngineCosts(47.8, 25.5, 25.8, f"Mixtral-8x7B's MoE layer, 8 experts top-2; {MEASURED_BY}"),
    (128, 8): EngineCosts(68.9, 34.7, 24.2, f"Qwen3-30B-A3B's MoE layer, 128 experts top-8; {MEASURED_BY}"),
}
"""(experts a layer, top-k) -> the tiered provider's costs measured on a MoE layer of that shape."""


def costs_for(shape: ModelShape) -> EngineCosts:
    """The measurement whose layer shape is nearest `shape`'s (log distance in experts plus in
    top-k; a tie goes to the costlier, Qwen3's), as measured: what the engine pays on it."""

    def distance(key: tuple[int, int]) -> tuple[float, float]:
        experts, top_k = key
        gap = abs(math.log2(shape.num_experts / experts)) + abs(math.log2(shape.top_k / top_k))
        return gap, -MEASURED[key].tier_us

    return MEASURED[min(MEASURED, key=distance)]


def priced(shape: ModelShape, profile: HardwareProfile) -> EngineCosts:
    """What a replay charges the engine's policies on `profile`: the profile's own figures where it
    names them (0: not priced), the measurement nearest `shape` for the others."""
    measured = costs_for(shape)
    own = (profile.tier_overhead_us, profile.miss_overhead_us, profile.stream_overhead_us)
    if all(v is None for v in own):
        return measured
    defaults = (measured.tier_us, measured.miss_us, measured.stream_us)
    tier, miss, stream = (m if v is None else v for v, m in zip(own, defaults, strict=True))
    given = [name for name, v in zip(("tier", "miss", "stream"), own, strict=True) if v is not None]
    source = f"profile {profile.name!r}'s {'/'.join(given)}"
    if len(given) < 3:
        source += f"; the rest: {measured.source}"
    return EngineCosts(tier, miss, stream, source)
