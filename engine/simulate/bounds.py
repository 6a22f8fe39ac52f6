"""The bound no policy can beat on a machine, and a policy's own misses perfectly overlapped.

What they are is told in `simulator`'s docstring. Here is how they are counted over a trace
streamed a step at a time: `BoundTally` takes each decode (step, MoE layer) with how many of its
routed experts missed tier 1 and keeps running totals (`LayerChain`), never per-step records, so
a replay can feed it as it runs (`TieredReplay.run(on_layer=...)`). `bound` feeds it the misses of
Belady's optimum (`caches.BeladyCache`, over `source.TraceFigures.uses`) or of an LRU cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..memory.routing_trace import Step
from .caches import BeladyCache, LoadFill, LRUCache, NextUses
from .machine import ExpertCosts
from .replay import SimulationError
from .source import TraceFigures, step_keys

CACHES = ("belady", "lru")


@dataclass(frozen=True)
class Bound:
    """The bound (module docstring): its tok/s, Belady's misses per token per tier, and which
    resource sets it: "layers" (the chain of layers, each its dense part and then its device
    experts beside its CPU misses), "link" or "disk"."""

    tokens_per_s: float
    misses_per_token: dict[str, float]
    limited_by: str


@dataclass
class LayerChain:
    """The decode steps' layers, one after another, each with its misses split between the CPU
    (within the layer, beside its device experts) and the link (any time before: an oracle
    prefetch), the split that `balance` makes best. Per layer, the CPU taking c of m misses
    makes it last dense + max(device experts - c x the largest device compute, c x `cpu`): free
    while the CPU finishes first (c up to where the two meet), then `cpu` a miss more, each one
    `link` less for the link. Fractional c: a miss split between the two, as q*'s SPLIT does."""

    link: float  # seconds a miss takes the link
    cpu: float  # seconds a miss takes the CPU
    free_chain: float = 0.0  # the layers with each one's free CPU share taken
    free_link: float = 0.0  # the link's misses left after those shares
    movable: float = 0.0  # misses the CPU could still take, at `cpu` each on the chain

    def add(self, dense: float, computes: Sequence[float], misses: int) -> None:
        """One layer of one step: `dense` seconds, its routed experts' device compute times, and
        how many of them miss tier 1."""
        device, largest = sum(computes), max(computes, default=0.0)
        meet = device / (largest + self.cpu) if largest + self.cpu > 0 else 0.0
        taken = min(float(misses), meet)
        self.free_chain += dense + max(device - taken * largest, taken * self.cpu)
        self.free_link += (misses - taken) * self.link
        self.movable += misses - taken

    def balance(self) -> tuple[float, float]:
        """(the chain of layers, the link) in seconds, with the misses past each layer's free CPU
        share moved from the link to the CPU until the two take equally long (or none is left)."""
        step = self.cpu + self.link
        moved = min(max((self.free_link - self.free_chain) / step, 0.0), self.movable) if step else 0.0
        return self.free_chain + moved * self.cpu, self.free_link - moved * self.link


class BoundTally:
    """A bound's running totals over the decode steps, fed each (step, MoE layer) in replay order
    (`layer`). O(1) in the trace's length."""

    def __init__(self, costs: ExpertCosts, *, host_misses: int = 0, warm: int = 0) -> None:
        self.costs = costs
        # A miss served by the link (and decoded on the device), or by the CPU (its fewest
        # tokens: a bound).
        self.chain = LayerChain(link=costs.link_s + costs.decode_s, cpu=costs.host_compute_s(1))
        self.misses = self.tokens = 0
        self._step: Step | None = None  # the step being fed (its tokens counted once)
        self.host_misses = host_misses  # the disk's reads over the decode steps
        self.warm = warm  # tier 2 starts warm (as in the replays): that many reads are free

    def layer(self, step: Step, layer: int, fast_misses: int, host_misses: int = 0) -> None:
        if step.phase != "decode":
            return
        if step is not self._step:
            self._step = step
            self.tokens += step.tokens
        c = self.costs
        computes = [c.fast_compute_s(t) for t in step.layers.get(layer, {}).values()]
        self.chain.add(c.dense_s(step.tokens), computes, fast_misses)
        self.misses += fast_misses
        self.host_misses += host_misses

    def on_layer(self, step: Step, layer: int, missed: Sequence[int]) -> None:
        """`layer` with a replay's own misses (`TieredReplay.run(on_layer=...)`)."""
        self.layer(step, layer, len(missed))

    def result(self) -> Bound:
        host_misses = max(0, self.host_misses - self.warm)
        layers_s, link_s = self.chain.balance()
        limits = {"layers": layers_s, "link": link_s, "disk": host_misses * self.costs.disk_s}
        top = max(limits.values())
        # Balanced, the chain and the link take equally long: the chain is named (ties go first).
        worst = next(k for k, v in limits.items() if v >= top * (1 - 1e-9))
        n = max(1, self.tokens)
        return Bound(
            tokens_per_s=self.tokens / limits[worst] if limits[worst] else 0.0,
            misses_per_token={"fast": self.misses / n, "host": host_misses / n},
            limited_by=worst,
        )


def bound_tally(
    steps: Iterable[Step],
    layers: Sequence[int],
    costs: ExpertCosts,
    *,
    fast_bytes: int,
    host_bytes: int | None,
    cache: str = "belady",
    fast_missing: Sequence[Sequence[int]] | None = None,
    figures: TraceFigures | None = None,
) -> BoundTally:
    """`bound`'s tally, whose disk figures (`host_misses`, `warm`) a policy's overlapped bound
    takes too (`BoundTally(costs, host_misses=..., warm=...)`)."""
    if cache not in CACHES:
        raise SimulationError(f"cache must be one of {', '.join(CACHES)}, got {cache!r}")
    figures = figures or TraceFigures.of(steps, layers)
    uses: NextUses = figures.uses
    if fast_missing is not None and len(fast_missing) != uses.steps:
        raise SimulationError(
            f"fast_missing has {len(fast_missing)} entries; the steps have {uses.steps} "
            f"({figures.steps} steps x {len(layers)} MoE layers)"
        )
    fast_cap = fast_bytes // costs.fast_bytes
    # The disk reads what neither tier holds: RAM and fast memory together hold up to both
    # budgets' distinct experts (exclusive tiers, as q*'s and the static split's), not tier 2's
    # alone (with a small tier 2 that bound read every use from disk, below every policy).
    host_cap = uses.keys if host_bytes is None else fast_cap + host_bytes // costs.stored_bytes

    def make(capacity: int) -> BeladyCache | LRUCache:
        return BeladyCache(uses, capacity) if cache == "belady" else LRUCache(capacity)

    fast, fill = make(fast_cap), LoadFill(fast_cap)  # filled at load, as q*'s
    host = make(max(host_cap, uses.widest))
    tally = BoundTally(costs, warm=min(host_cap, uses.keys))
    i = 0
    for step in steps:
        for layer, keys in zip(layers, step_keys(step, layers), strict=True):
            missed = fill.kept(fast.missing(keys)) if fast_missing is None else fast_missing[i]
            tally.layer(step, layer, len(missed), len(host.missing(keys)))
            i += 1
    return tally


def bound(
    steps: Iterable[Step],
    layers: Sequence[int],
    costs: ExpertCosts,
    *,
    fast_bytes: int,
    host_bytes: int | None,
    cache: str = "belady",
    fast_missing: Sequence[Sequence[int]] | None = None,
    figures: TraceFigures | None = None,
) -> Bound:
    """`Bound` over the decode steps of `steps` (walked twice unless `figures` of them over
    `layers` are given: a list, or a `source.TraceSource`), both tiers run by `cache` ("belady",
    or "lru" for the online bound), or tier 1's misses given (`fast_missing`, per step and layer
    in replay order, keyed as `source.step_keys`; SimulationError unless it has one entry per step
    and layer)."""
    return bound_tally(
        steps,
        layers,
        costs,
        fast_bytes=fast_bytes,
        host_bytes=host_bytes,
        cache=cache,
        fast_missing=fast_missing,
        figures=figures,
    ).result()
