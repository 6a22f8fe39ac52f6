"""The baselines a replay compares q* with, on the same steps, machine and timeline rules.

- `static`: llama.cpp's ``--n-cpu-moe`` / ``-ot`` split. A profiling pass (`profiling_steps`: the
  first `PROFILE_FRACTION` of the decode tokens, or another trace) counts each (layer, expert)'s
  uses; the most used fill
  tier 1 and stay there, the rest are computed on the CPU from RAM (the next most used that fit
  tier 2), or from the disk (read at each use: they do not fit RAM). Nothing moves while decoding.
- `static-layers`: llama.cpp's ``--n-cpu-moe N`` (or ``-ot`` by layer): whole layers' experts in
  tier 1, the last layers (``--n-cpu-moe N`` keeps the first N layers' experts on the CPU), as
  many as fit; every other expert computed on the CPU from RAM (or the disk, past the RAM budget).
  No profiling pass and nothing moves while decoding.
- `stream`: no cache. Every routed expert is copied into tier 1 for its use (tier 2 an LRU of its
  budget, tier 3 read on a miss), no CPU compute.
- `belady`: tier 1 as one cache of every layer's experts run by the offline optimum (evict the
  expert whose next use is farthest), every miss streamed, no CPU compute. Tier 1 starts filled,
  untimed, as q*'s and the static split's do, with the experts the trace uses first (the
  optimum's own fill: `stats.filled_at_load`).
The streaming baselines get a perfect one-layer-ahead prefetch: a layer's copies may start when
the layer before it starts. (The per-layer LRU of mixtral-offloading, "layer-lru", runs through the
engine's own tiers: `replay.TieredReplay(placement="layer-lru")`.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice

from ..memory.routing_trace import Step
from ..memory.tiers import HostTier
from .caches import BeladyCache, LoadFill
from .machine import ExpertCosts, Timeline
from .mover import Tally, warm
from .source import TraceFigures, step_keys

PROFILE_FRACTION = 0.25
"""The static split's profiling pass: the first quarter of the decode tokens."""


def layer_steps(steps: Iterable[Step], layers: Sequence[int]) -> list[list[int]]:
    """Every (step, layer)'s routed experts as integer keys (`source.step_keys`), in replay order:
    the input of `stats.belady_missing`."""
    return [keys for step in steps for keys in step_keys(step, layers)]


class _Streamer:
    """Copies experts into tier 1 over the link, tier 2 an LRU of `host_bytes` before the disk."""

    def __init__(self, costs: ExpertCosts, timeline: Timeline, host_bytes: int | None) -> None:
        self.costs, self.timeline = costs, timeline
        self.host: HostTier[bool] = HostTier(host_bytes)
        self.bytes: Counter[str] = Counter()
        self.host_misses = 0

    def bring(self, key: tuple[int, int], issue: float) -> float:
        """Copy `key` into tier 1, starting no earlier than `issue`; when it is there."""
        c = self.costs
        ready = issue
        if self.host.get(key) is None:
            self.host_misses += 1
            self.bytes["storage->host"] += c.stored_bytes
            ready = self.timeline.run("disk", issue, c.disk_s)
            self.host.put(key, True, c.stored_bytes)
        self.bytes["host->fast"] += c.stored_bytes
        ready = self.timeline.run("link", ready, c.link_s)
        return self.timeline.run("device", ready, c.decode_s) if c.decode_s else ready


def replay_streaming(
    steps: Iterable[Step],
    layers: Sequence[int],
    costs: ExpertCosts,
    *,
    fast_bytes: int,
    host_bytes: int | None,
    num_experts: int,
    cached: bool,
    figures: TraceFigures | None = None,
) -> Tally:
    """`stream` (cached False) or `belady` (cached True: tier 1 holds fast_bytes of experts, run
    by `caches.BeladyCache` over `figures.uses`, the `TraceFigures` of `steps` over `layers`:
    walked once more first if not given)."""
    timeline = Timeline(costs.device)
    streamer = _Streamer(costs, timeline, host_bytes)
    warm(streamer.host, ((layer, e) for layer in layers for e in range(num_experts)), costs.stored_bytes)
    capacity = fast_bytes // costs.fast_bytes
    belady = BeladyCache((figures or TraceFigures.of(steps, layers)).uses, capacity) if cached else None
    fill = LoadFill(capacity)
    tally, now, prev_start = Tally(), 0.0, 0.0
    for step in steps:
        start_step, host_misses, moved = now, streamer.host_misses, Counter(streamer.bytes)
        misses = 0
        for layer, keys in zip(layers, step_keys(step, layers), strict=True):
            routed = step.layers.get(layer, {})
            miss = {k & 0xFFFFF for k in (keys if belady is None else fill.kept(belady.missing(keys)))}
            hidden = timeline.run("device", now, costs.dense_s(step.tokens))
            ends = [hidden]
            for e in sorted(routed):
                ready = streamer.bring((layer, e), prev_start) if e in miss else 0.0
                s = costs.fast_compute_s(routed[e])
                ends.append(timeline.run("device", max(hidden, ready), s))
            misses += len(miss)
            prev_start, now = now, max(ends)
        if step.phase == "decode":
            tally.tokens += step.tokens
            tally.seconds += now - start_step
            tally.fast_misses += misses
            tally.host_misses += streamer.host_misses - host_misses
            tally.bytes.update(streamer.bytes - moved)
    return tally


def profiling_steps(
    steps: Iterable[Step], fraction: float = PROFILE_FRACTION, *, decode_steps: int | None = None
) -> Iterator[Step]:
    """The profiling pass: the first `fraction` of the decode steps (at least one) of `steps`, of
    which there are `decode_steps` (counted by one more walk of `steps` if not given), streamed.
    The static split places experts by it; "qstar-profiled" starts q* from it
    (`TieredReplay(warm_start=)`), as `Engine.from_pretrained(..., routing_profile=PATH)` starts
    the engine from a recorded trace."""
    if decode_steps is None:
        decode_steps = sum(1 for s in steps if s.phase == "decode")
    return islice((s for s in steps if s.phase == "decode"), max(1, int(decode_steps * fraction)))


def replay_static(
    steps: Iterable[Step],
    layers: Sequence[int],
    costs: ExpertCosts,
    *,
    fast_bytes: int,
    host_bytes: int | None,
    num_experts: int,
    profile: Iterable[Step],
    by_layer: bool = False,
) -> Tally:
    """llama.cpp's static split (module docstring), placed by the routing of `profile`
    (`profiling_steps(steps)`, or another trace's steps); `by_layer`: `static-layers`, whole layers
    from the last one down (`profile` unused)."""
    n_fast = fast_bytes // costs.fast_bytes
    if by_layer:
        ranked = [(layer, e) for layer in reversed(layers) for e in range(num_experts)]
        n_fast -= n_fast % num_experts  # whole layers only
    else:
        uses: Counter[tuple[int, int]] = Counter()
        for step in profile:
            for layer, routed in step.layers.items():
                uses.update({(layer, e): n for e, n in routed.items()})
        # Most used first; experts the profiling pass never saw after them, in (layer, expert) order.
        keys = [(layer, e) for layer in layers for e in range(num_experts)]
        ranked = sorted(keys, key=lambda k: (-uses[k], k))
    n_host = len(ranked) if host_bytes is None else host_bytes // costs.stored_bytes
    resident = set(ranked[:n_fast])
    in_ram = resident | set(ranked[n_fast : n_fast + n_host])
    timeline = Timeline(costs.device)
    tally, now = Tally(), 0.0
    for step in steps:
        start_step = now
        for layer in layers:
            routed = step.layers.get(layer, {})
            hidden = timeline.run("device", now, costs.dense_s(step.tokens))
            ends = [hidden]
            for e in sorted(routed):
                t = routed[e]
                if (layer, e) in resident:
                    ends.append(timeline.run("device", hidden, costs.fast_compute_s(t)))
                    continue
                ready, from_disk = hidden, (layer, e) not in in_ram
                if costs.device == "cuda":  # hidden states device -> host and back (latency-bound)
                    ready = hidden + costs.activation_s * t
                if from_disk and step.phase == "decode":
                    tally.host_misses += 1
                    tally.bytes["storage->host"] += costs.stored_bytes
                if from_disk:
                    ready = timeline.run("disk", ready, costs.disk_s)
                if step.phase == "decode":
                    tally.fast_misses += 1
                    tally.cpu_experts += 1
                    tally.bytes["activations"] += costs.activation_bytes * t if costs.device == "cuda" else 0
                ends.append(timeline.run("cpu", ready, costs.host_compute_s(t)))
            now = max(ends)
        if step.phase == "decode":
            tally.tokens += step.tokens
            tally.seconds += now - start_step
    return tally
