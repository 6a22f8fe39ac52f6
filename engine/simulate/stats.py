"""What a routing trace's routing looks like: temporal reuse, cross-layer correlation, popularity
skew, and the misses of three cache policies over it (issue 33).

`trace_stats(records, num_experts=...)` counts, over the records of one phase (decode by default):

- **reuse** (temporal): over every record (seq, t, l) whose sequence also has a record for token
  t - 1 at the same layer l, the routed experts of t at l that t - 1 also routed at l, divided by
  all routed experts of those records: sum |E(t,l) & E(t-1,l)| / sum |E(t,l)|. Random baseline
  (`reuse_random`): both sets drawn uniformly, sum |E(t,l)| |E(t-1,l)| / n / sum |E(t,l)| = top_k / n
  for a fixed top_k (n = num_experts). Mixtral-8x7B decode, published: 37.5% against 25%.
- **cross_layer** (same index, next layer): the trace's MoE layers sorted, l' the one after l; over
  every token with records at both l and l', the experts of l whose index it also routes at l',
  divided by all its experts at l: sum |E(t,l) & E(t,l')| / sum |E(t,l)|. Random baseline
  (`cross_layer_random`) as for reuse: top_k / n. Mixtral, published: 24.2% against 25%.
- **top10_share** (popularity skew): uses of each of the layers x n (layer, expert) pairs (unused
  pairs count 0), sorted most used first; the share of all uses carried by the first 10% of the
  pairs, a fractional last pair counting pro rata (0.1 x 256 = 25.6 pairs: the 25 most used and
  0.6 of the 26th). Uniform routing: 10%, plus the noise of a finite trace. Mixtral: 13.6%.
- **misses per token** of one cache of C = round(cache_fraction x layers x n) (layer, expert) entries
  shared by all layers, starting empty, fed the records in (seq, token, layer) order (sequences one
  after another, sharing the cache). A record is one step: its hits are touched, then as many
  entries as it misses are evicted (never one of its own experts: a layer's routed experts are
  resident together), then its misses are loaded. Every miss counts, the first (cold) ones too;
  divided by the number of (seq, token) pairs. Eviction orders:
  - `lru`: the least recently used entry (ties within a record: the one earlier in router order).
  - `frequency`: the lowest decayed routing frequency, as the engine's
    `memory.routing.RoutingFrequency` counts: each record of layer l multiplies every count of layer l
    by `decay` (0.9), then adds 1 to each expert it routes, before the cache is looked at; counts
    are kept for evicted entries too. Ties: least recently used, then the lower (layer, expert).
  - `belady`: the offline optimum: the entry whose next use is farthest in the future (never used
    again = infinitely far; ties: the lower (layer, expert)). Exact, next uses precomputed, O(n log n).
  Mixtral, published (128 of 256 entries): 28.6 (LRU), 27.0 (decayed frequency), 12.2 (Belady).

"Uses" and "routed experts" are the `experts` of the records; weights are not looked at.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..memory.routing_trace import RoutingRecord, RoutingTraceError
from . import caches

# The statistic's decay, not the engine's (`memory.routing.ROUTING_DECAY`): the trace statistic of
# the published "decayed frequency" figure, whose decay is not given; 0.9 kept it within 6% of it.
DEFAULT_DECAY = 0.9


@dataclass(frozen=True)
class TraceStats:
    """`trace_stats`'s figures (defined in the module docstring). Shares are fractions in [0, 1];
    a figure with nothing to count (e.g. reuse of one-token sequences) is NaN (None in JSON)."""

    phase: str | None
    records: int
    tokens: int  # (seq, token) pairs
    sequences: int
    layers: int  # distinct MoE layers in the records
    num_experts: int
    top_k: float  # mean routed experts per record
    reuse: float
    reuse_random: float
    cross_layer: float
    cross_layer_random: float
    top10_share: float
    cache_fraction: float
    cache_entries: int
    decay: float
    accesses_per_token: float
    misses_per_token_lru: float
    misses_per_token_frequency: float
    misses_per_token_belady: float

    def to_dict(self) -> dict[str, Any]:
        """The figures as a JSON-able dict (NaN -> None)."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def trace_stats(
    records: Iterable[RoutingRecord],
    *,
    num_experts: int,
    cache_fraction: float = 0.5,
    phase: str | None = "decode",
    decay: float = DEFAULT_DECAY,
) -> TraceStats:
    """The figures of the module docstring over the `records` of `phase` (None: all records).

    ValueError for no records or a cache smaller than one record's experts; RoutingTraceError for
    an expert >= `num_experts` or two records of the same (seq, token, layer)."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    chosen = [r for r in records if phase is None or r.phase == phase]
    if not chosen:
        raise ValueError(f"no {phase or ''} records to count".replace("  ", " "))
    chosen.sort(key=lambda r: (r.seq, r.token, r.layer))
    by_place: dict[tuple[int, int, int], frozenset[int]] = {}
    for r in chosen:
        bad = [e for e in r.experts if e >= num_experts]
        if bad:
            raise RoutingTraceError(
                f"seq {r.seq} token {r.token} layer {r.layer}: expert {bad[0]} >= num_experts {num_experts}"
            )
        place = (r.seq, r.token, r.layer)
        if place in by_place:
            raise RoutingTraceError(f"seq {r.seq} token {r.token} layer {r.layer}: two records")
        by_place[place] = frozenset(r.experts)
    layer_ids = sorted({r.layer for r in chosen})
    next_layer = dict(zip(layer_ids, layer_ids[1:], strict=False))
    tokens = len({(r.seq, r.token) for r in chosen})

    reuse_hit = reuse_all = 0
    reuse_chance = 0.0
    cross_hit = cross_all = 0
    cross_chance = 0.0
    for (seq, tok, layer), now in by_place.items():
        prev = by_place.get((seq, tok - 1, layer))
        if prev is not None:
            reuse_hit += len(now & prev)
            reuse_all += len(now)
            reuse_chance += len(now) * len(prev) / num_experts
        after = next_layer.get(layer)
        there = by_place.get((seq, tok, after)) if after is not None else None
        if there is not None:
            cross_hit += len(now & there)
            cross_all += len(now)
            cross_chance += len(now) * len(there) / num_experts

    slot = {layer: i for i, layer in enumerate(layer_ids)}
    steps = [[slot[r.layer] * num_experts + e for e in r.experts] for r in chosen]
    uses = np.bincount(
        np.fromiter((k for s in steps for k in s), dtype=np.int64), minlength=len(slot) * num_experts
    )
    accesses = int(uses.sum())
    capacity = round(cache_fraction * len(layer_ids) * num_experts)
    widest = max(len(s) for s in steps)
    if capacity < widest:
        raise ValueError(f"a cache of {capacity} entries cannot hold one record's {widest} experts")
    layer_of = [slot[r.layer] for r in chosen]

    return TraceStats(
        phase=phase,
        records=len(chosen),
        tokens=tokens,
        sequences=len({r.seq for r in chosen}),
        layers=len(layer_ids),
        num_experts=num_experts,
        top_k=accesses / len(chosen),
        reuse=_share(reuse_hit, reuse_all),
        reuse_random=_share(reuse_chance, reuse_all),
        cross_layer=_share(cross_hit, cross_all),
        cross_layer_random=_share(cross_chance, cross_all),
        top10_share=top_share(uses, 0.10),
        cache_fraction=cache_fraction,
        cache_entries=capacity,
        decay=decay,
        accesses_per_token=accesses / tokens,
        misses_per_token_lru=lru_misses(steps, capacity) / tokens,
        misses_per_token_frequency=frequency_misses(
            steps, layer_of, capacity, len(layer_ids), num_experts, decay
        )
        / tokens,
        misses_per_token_belady=belady_misses(steps, capacity) / tokens,
    )


def top_share(uses: np.ndarray, fraction: float) -> float:
    """The share of `uses.sum()` carried by the most used `fraction` of the entries of `uses`, a
    fractional last entry counting pro rata."""
    total = float(uses.sum())
    if total == 0:
        return math.nan
    ranked = np.sort(uses.astype(np.float64))[::-1]
    m = fraction * len(ranked)
    whole = int(math.floor(m))
    carried = float(ranked[:whole].sum())
    if whole < len(ranked):
        carried += (m - whole) * float(ranked[whole])
    return carried / total


def lru_misses(steps: Sequence[Sequence[int]], capacity: int) -> int:
    """Misses of an LRU cache of `capacity` entries fed `steps` (each a record's distinct keys)."""
    return sum(len(missing) for missing in lru_missing(steps, capacity))


def lru_missing(steps: Sequence[Sequence[int]], capacity: int) -> list[list[int]]:
    """The keys each step misses in an LRU cache of `capacity` entries (`lru_misses`)."""
    cache = caches.LRUCache(capacity)
    return [cache.missing(keys) for keys in steps]


def frequency_misses(
    steps: Sequence[Sequence[int]],
    layer_of: Sequence[int],
    capacity: int,
    layers: int,
    num_experts: int,
    decay: float = DEFAULT_DECAY,
) -> int:
    """Misses of a cache evicting the lowest decayed routing frequency (module docstring); key =
    layer slot x num_experts + expert, `layer_of[i]` the layer slot of `steps[i]`."""
    n = layers * num_experts
    score = np.zeros(n)
    last = np.full(n, -1, dtype=np.int64)
    cached = np.zeros(n, dtype=bool)
    size = misses = 0
    for i, keys in enumerate(steps):
        block = slice(layer_of[i] * num_experts, (layer_of[i] + 1) * num_experts)
        score[block] *= decay
        idx = np.fromiter(keys, dtype=np.int64, count=len(keys))
        score[idx] += 1.0
        missing = [k for k in keys if not cached[k]]
        over = size + len(missing) - capacity
        if over > 0:
            masked = np.where(cached, score, np.inf)
            masked[idx] = np.inf
            for _ in range(over):
                low = masked.min()
                ties = np.flatnonzero(masked == low)
                victim = int(ties[np.argmin(last[ties])])  # argmin: first (lowest key) of equal ages
                cached[victim] = False
                masked[victim] = np.inf
            size -= over
        last[idx] = i
        cached[missing] = True
        size += len(missing)
        misses += len(missing)
    return misses


def belady_misses(steps: Sequence[Sequence[int]], capacity: int) -> int:
    """Misses of Belady's offline optimum: evict the entry whose next use is farthest (never used
    again: farthest of all; ties: the lower key)."""
    return sum(len(missing) for missing in belady_missing(steps, capacity))


def belady_missing(steps: Sequence[Sequence[int]], capacity: int) -> list[list[int]]:
    """The keys each step misses under Belady's offline optimum (`belady_misses`)."""
    cache = caches.BeladyCache(caches.NextUses.of(steps), capacity)
    return [cache.missing(keys) for keys in steps]


def filled_at_load(missing: Sequence[Sequence[int]], capacity: int) -> list[list[int]]:
    """`missing` (a cache's misses per step, the cache starting empty) for the same cache filled
    before the first step, untimed, as the engine fills tier 1 at load: with the first `capacity`
    distinct keys the steps use, whose first misses go. Belady's and LRU's caches evict nothing
    until they are full and then hold exactly those keys, so the rest of their misses is theirs
    filled so (LRU: each of those keys as fresh as its first use made it). For Belady it is the
    best fill too: the keys needed soonest."""
    fill = caches.LoadFill(capacity)
    return [fill.kept(keys) for keys in missing]


def _share(part: float, whole: float) -> float:
    return part / whole if whole else math.nan
