"""A ranked tier's eviction order without sorting the tier: one lazy heap per layer.

Tier 2 under q* evicts the expert with the lowest decayed routing frequency, least recently used
among equals (`tiers.LRUTier` with a `rank`). Sorting every key for each eviction cost 0.6 ms a
put at 3,700 keys (Qwen3-30B's tier 2 at 60%) and 2 ms at 8,900 (DeepSeek-V3's), on the thread
that holds the tiers' lock, once per disk read: more than the read of a 10 MB block.

`RankedKeys` keeps, per MoE layer, a heap of (undecayed count, recency, key) entries. Both parts
only grow while a key stays in the tier (a use adds to the count, a touch renews the recency), so
an entry is a lower bound of its key's current place: at the top of a heap it is checked and, if
outdated, pushed again with the key's current values (or dropped with the key gone). Within a
layer the decay multiplies every count alike, so the undecayed order is the decayed one; the
layers' heads are compared by their decayed counts (`rank(key)`, the same product the sort used)
and recency. A layer whose counts were rescaled (`LayeredRank.epoch`) rebuilds its heap. An
eviction then costs a look at each layer's head, not a sort of the tier.

The order equals ``sorted(keys, key=rank)`` over the tier's LRU order, except where rounding makes
two different counts of a layer equal once decayed: there the smaller undecayed count goes first.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from ..model.experts import ExpertKey

Entry = tuple[float, int, ExpertKey]  # (undecayed count, recency, key)


@runtime_checkable
class LayeredRank(Protocol):
    """A rank per expert that is a per-layer undecayed count times the layer's scale
    (`routing.RoutingFrequency`): `raw` only grows until the layer's `epoch` changes."""

    def __call__(self, key: ExpertKey) -> float: ...

    def raw(self, key: ExpertKey) -> float: ...

    def scale(self, layer: int) -> float: ...

    def epoch(self, layer: int) -> int: ...


class RankedKeys:
    """The eviction order of a ranked tier (module docstring). `recency` is the tier's key ->
    recency number (larger: more recent), kept by the tier; `add` and `discard` follow its
    inserts and removals. Iterate with `order()`, and `close()` the iteration before the tier
    changes again."""

    _SLACK = 64  # entries a heap may hold beyond twice its live keys before it is rebuilt

    def __init__(self, rank: LayeredRank, recency: dict[ExpertKey, int]) -> None:
        self.rank, self.recency = rank, recency
        self._heaps: dict[int, list[Entry]] = {}
        self._epochs: dict[int, int] = {}
        self._latest: dict[ExpertKey, tuple[float, int]] = {}  # the newest entry pushed per key
        self._live: Counter[int] = Counter()
        # No heaps until the first eviction: a tier with room (tier 2 holding every expert)
        # never pays for them.
        self._active = False

    def add(self, key: ExpertKey) -> None:
        """`key` entered the tier (its recency set)."""
        self._live[key[0]] += 1
        if self._active:
            self._push(key, (self.rank.raw(key), self.recency[key]))

    def discard(self, key: ExpertKey) -> None:
        """`key` left the tier (its entries are dropped when they come up)."""
        self._live[key[0]] -= 1
        self._latest.pop(key, None)

    def order(self) -> RankedOrder:
        if not self._active:
            for layer in {k[0] for k in self.recency}:
                self._rebuild(layer)
            self._active = True
        return RankedOrder(self)

    # ---- heaps ----------------------------------------------------------------------------
    def _push(self, key: ExpertKey, current: tuple[float, int]) -> None:
        layer = key[0]
        heap = self._heap(layer)
        if self._latest.get(key) != current:
            heapq.heappush(heap, (current[0], current[1], key))
            self._latest[key] = current
        if len(heap) > 2 * self._live[layer] + self._SLACK:
            self._rebuild(layer)

    def _heap(self, layer: int) -> list[Entry]:
        """`layer`'s heap, rebuilt first if its counts were rescaled since it was built."""
        if self._epochs.get(layer) != self.rank.epoch(layer):
            self._rebuild(layer)
        return self._heaps[layer]

    def _rebuild(self, layer: int) -> None:
        entries = [(self.rank.raw(k), r, k) for k, r in self.recency.items() if k[0] == layer]
        heapq.heapify(entries)
        self._heaps[layer] = entries
        self._epochs[layer] = self.rank.epoch(layer)
        for raw, r, k in entries:
            self._latest[k] = (raw, r)

    def top(self, layer: int) -> Entry | None:
        """`layer`'s first key in eviction order (its entry made current), or None."""
        heap = self._heap(layer)
        while heap:
            raw, r, key = heap[0]
            now = self.recency.get(key)
            if now is None:  # gone from the tier
                heapq.heappop(heap)
                continue
            current = (self.rank.raw(key), now)
            if current == (raw, r):
                return heap[0]
            heapq.heappop(heap)  # outdated: a lower bound of where the key now belongs
            if self._latest.get(key) != current:
                heapq.heappush(heap, (current[0], current[1], key))
                self._latest[key] = current
        return None


class RankedOrder(Iterator[ExpertKey]):
    """One pass over a `RankedKeys` in eviction order: lowest decayed count first, least recent
    among equals. Taken entries are put back by `close` (the tier must not change before it)."""

    def __init__(self, index: RankedKeys) -> None:
        self.index = index
        self._taken: list[Entry] = []
        self._heads: list[tuple[float, int, int]] = []  # (decayed count, recency, layer)
        for layer in list(index._heaps):
            self._push_head(layer)

    def _push_head(self, layer: int) -> None:
        entry = self.index.top(layer)
        if entry is not None:
            heapq.heappush(self._heads, (entry[0] * self.index.rank.scale(layer), entry[1], layer))

    def __next__(self) -> ExpertKey:
        if not self._heads:
            raise StopIteration
        _, _, layer = heapq.heappop(self._heads)
        entry = heapq.heappop(self.index._heaps[layer])
        self._taken.append(entry)
        self._push_head(layer)
        return entry[2]

    def close(self) -> None:
        """Put the taken entries back (those of keys still in the tier)."""
        for entry in self._taken:
            if entry[2] in self.index.recency:
                heapq.heappush(self.index._heaps[entry[2][0]], entry)
        self._taken.clear()
        self._heads.clear()
