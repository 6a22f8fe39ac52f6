"""Tier 1: the fast tier (a pinned hot set, an LRU and a segment of recent copies) and the
per-layer LRU of the "stream" baseline, on `tiers.LRUTier`."""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from itertools import repeat
from operator import itemgetter
from typing import Any, TypeVar

from ..model.experts import ExpertKey
from .tiers import LRUTier

V = TypeVar("V")


class FastTier(LRUTier[ExpertKey, V]):
    """Tier 1: a pinned hot set that `put` never evicts, plus an LRU for the rest, plus a segment
    of recent copies.

    `set_hot(keys)` re-evaluates the hot set: resident keys among `keys` become pinned, at most
    `max_pinned_fraction` of the capacity in bytes; the others are unpinned.

    The recent segment (`recent_capacity` bytes of the capacity, none until it is sized: see
    `recent.RecentCopies`) holds the copies `put_recent` keeps, oldest first: it evicts only its
    own oldest, and `put`, `resize` and `eviction_order`'s users never take them. A kept copy is
    a hit like any resident. What a segment of any size would hit is counted: every copy kept or
    let go (`let_go`) is remembered for `depth_limit` more copies, and a use of one (a hit on a
    kept copy, a miss on one let go) counts in `depth_hits` at its depth, the copies used since;
    a segment of X copies would have hit the uses at depths under X. The rest of the tier's room
    is the LRU's.

    A hit table (`hits`): per layer, expert -> its value or None, kept as the tier changes, so a
    layer's routed experts are found, and marked used, by C-level calls over the list of them,
    without Python per expert (a decode step of Qwen3-30B-A3B asks it 48 times, 8 experts each).
    """

    def __init__(self, capacity_bytes: int | None, *, max_pinned_fraction: float = 0.5, **hooks: Any) -> None:
        super().__init__("fast", capacity_bytes, **hooks)
        self.max_pinned_fraction = max_pinned_fraction
        self.recent: OrderedDict[ExpertKey, int] = OrderedDict()  # key -> bytes, oldest first
        self.recent_capacity = self.recent_used = 0
        self.copies: OrderedDict[ExpertKey, int] = OrderedDict()  # key -> its last use's number
        self.copies_seen = self.depth_limit = 0
        self.depth_hits: Counter[int] = Counter()
        self._rows: dict[int, list[V | None]] = {}  # layer -> expert -> value (`hits`)
        self._held: dict[int, list[bool]] = {}  # layer -> expert -> held (tested without __eq__)

    # ---- the hit table -----------------------------------------------------------------------
    def _set_row(self, key: ExpertKey, value: V | None) -> None:
        row, held = self._rows.get(key[0]), self._held.get(key[0])
        if row is None or held is None:
            row = self._rows[key[0]] = []
            held = self._held[key[0]] = []
        if key[1] >= len(row):
            row.extend([None] * (key[1] + 1 - len(row)))
            held.extend([False] * (key[1] + 1 - len(held)))
        row[key[1]] = value
        held[key[1]] = value is not None

    def hits(self, layer: int, experts: list[int]) -> tuple[V, ...] | None:
        """The values of `layer`'s `experts` (distinct ids) in that order, each marked most
        recently used and counted a hit, or None, touching nothing, when any is not held: the
        all-hit test of a routed layer, one lookup over the layer's row (`get_all`'s semantics
        with C-level calls over the ids: no dict probe or bytecode loop per expert)."""
        row, held = self._rows.get(layer), self._held.get(layer)
        if row is None or held is None or not experts:
            return None
        pick = itemgetter(*experts)
        try:
            # `None in values` would call each value's __eq__ (a dataclass's: Python code)
            flags = pick(held)
        except IndexError:  # an expert past the highest one ever held
            return None
        if len(experts) == 1:
            if not flags:
                return None
            found = (row[experts[0]],)
        elif not all(flags):
            return None
        else:
            found = pick(row)
        keys = list(zip(repeat(layer), experts))
        if self._ranked is not None:  # the layered rank's recency, as `_touch` per key
            tick = self._tick
            self._recency.update(zip(keys, range(tick + 1, tick + 1 + len(keys)), strict=True))
            self._tick = tick + len(keys)
        if not self._by_recency:
            deque(map(self._items.move_to_end, keys), maxlen=0)
        self.counters.hits += len(keys)
        if self.recent:
            for key in keys:
                self._recent_hit(key)
        return found

    @property
    def _by_recency(self) -> bool:
        """Whether the order of use is the recency numbers alone: a tier ranked by a layered
        rank evicts by (rank, recency) and never reads the LRU order, so `hits` leaves it and
        `keys` sorts by recency (the same order: both change on the same uses)."""
        return self._ranked is not None and self.rank is self._ranked.rank

    def held(self) -> list[ExpertKey]:
        """The keys held, in no particular order (`keys` orders them, a sort when ranked)."""
        return list(self._items)

    def keys(self) -> list[ExpertKey]:
        if self._by_recency:
            return sorted(self._items, key=self._recency.__getitem__)
        return super().keys()

    def _insert(self, key: ExpertKey, value: V, nbytes: int) -> None:
        super()._insert(key, value, nbytes)
        self._set_row(key, value)

    def replace(self, key: ExpertKey, value: V) -> None:
        super().replace(key, value)
        self._set_row(key, value)

    # ---- the recent segment -----------------------------------------------------------------
    def _over(self, nbytes: int) -> int:
        assert self.capacity_bytes is not None
        return self.used_bytes - self.recent_used + nbytes - (self.capacity_bytes - self.recent_capacity)

    def _kept_apart(self, key: ExpertKey) -> bool:
        return key in self.recent

    def fits(self, nbytes: int, key: ExpertKey | None = None) -> bool:
        if self.capacity_bytes is None:
            return True
        return nbytes <= self.capacity_bytes - self.recent_capacity - self.pinned_bytes()

    def has_room(self, nbytes: int, key: ExpertKey | None = None) -> bool:
        return self.capacity_bytes is None or self._over(nbytes) <= 0

    def put_recent(self, key: ExpertKey, value: V, nbytes: int) -> list[ExpertKey] | None:
        """Keep `key` as the newest recent copy, evicting the oldest ones that leave no room;
        returns them. None, keeping nothing, when the segment cannot hold `nbytes`."""
        if key in self._items:
            self.get(key, count=False)
            return []
        if nbytes > self.recent_capacity:
            return None
        evicted = self._trim_recent(self.recent_capacity - nbytes)
        self._insert(key, value, nbytes)
        self.recent[key] = nbytes
        self.recent_used += nbytes
        self._note_copy(key)
        return evicted

    def let_go(self, key: ExpertKey) -> None:
        """`key`'s staged copy was used and not kept: remembered as if it had been."""
        self._note_copy(key)

    def set_recent_capacity(self, nbytes: int) -> list[ExpertKey]:
        """Give the recent segment `nbytes` of the capacity (the LRU the rest); returns what left."""
        self.recent_capacity = max(0, nbytes)
        return self._trim_recent(self.recent_capacity) + self._fit_lru()

    def _fit_lru(self) -> list[ExpertKey]:
        """Evict the LRU's coldest (pinned last) until it fits its part of the capacity."""
        evicted = []
        while self.capacity_bytes is not None and self._over(0) > 0:
            victim = self.evict_coldest(include_pinned=True)
            if victim is None:
                break
            evicted.append(victim)
        return evicted

    def _trim_recent(self, limit: int) -> list[ExpertKey]:
        evicted = []
        while self.recent and self.recent_used > limit:
            key = next(iter(self.recent))
            self._drop(key)  # still remembered, at its last use
            evicted.append(key)
        return evicted

    def _leave_recent(self, key: ExpertKey) -> None:
        nbytes = self.recent.pop(key, None)
        if nbytes is not None:
            self.recent_used -= nbytes

    def _note_copy(self, key: ExpertKey) -> None:
        self.copies_seen += 1
        self.copies[key] = self.copies_seen
        self.copies.move_to_end(key)
        while len(self.copies) > self.depth_limit:
            self.copies.popitem(last=False)

    def _count_depth(self, key: ExpertKey) -> None:
        self.depth_hits[self.copies_seen - self.copies[key]] += 1

    def _recent_hit(self, key: ExpertKey) -> None:
        if key in self.recent:
            if key in self.copies:
                self._count_depth(key)
            self.recent.move_to_end(key)
            self._note_copy(key)

    def stats(self) -> dict[str, int | None]:
        """`LRUTier.stats`, with the recent segment's room, bytes held and copies."""
        return {
            **super().stats(),
            "recent_capacity_bytes": self.recent_capacity,
            "recent_bytes": self.recent_used,
            "recent": len(self.recent),
        }

    # ---- LRUTier, with the segment ----------------------------------------------------------
    def get(self, key: ExpertKey, *, count: bool = True) -> V | None:
        value = super().get(key, count=count)
        if value is not None:
            self._recent_hit(key)
        elif count and key in self.copies:  # a copy let go, or that left the segment
            self._count_depth(key)
            del self.copies[key]
        return value

    def get_all(self, keys: list[ExpertKey]) -> list[V] | None:
        found = super().get_all(keys)
        if found is not None and self.recent:
            for key in keys:
                self._recent_hit(key)
        return found

    def pop(self, key: ExpertKey) -> V | None:
        self._leave_recent(key)
        if key in self._items:
            self._set_row(key, None)
        return super().pop(key)

    def _drop(self, key: ExpertKey) -> None:
        self._leave_recent(key)
        self._set_row(key, None)
        super()._drop(key)

    def resize(self, capacity_bytes: int | None) -> list[ExpertKey]:
        """As `LRUTier.resize`, the recent segment first cut to fit the new capacity."""
        evicted: list[ExpertKey] = []
        if capacity_bytes is not None and self.recent_capacity > capacity_bytes:
            self.recent_capacity = capacity_bytes
            evicted = self._trim_recent(capacity_bytes)
        return evicted + super().resize(capacity_bytes) + self._fit_lru()

    # ---- the hot set ------------------------------------------------------------------------
    def pin(self, key: ExpertKey) -> bool:
        """Pin a resident key; False if absent or it would exceed the pinned-bytes cap."""
        if key not in self._items:
            return False
        if key in self.pinned:
            return True
        size = self._items[key][1]
        if self.capacity_bytes is not None:
            cap = int(self.capacity_bytes * self.max_pinned_fraction)
            if self.pinned_bytes() + size > cap:
                return False
        self._pin(key)
        return True

    def unpin(self, key: ExpertKey) -> None:
        self._unpin(key)

    def set_hot(self, keys: list[ExpertKey]) -> list[ExpertKey]:
        """Pin the resident keys of `keys` (hottest first) within the cap, recent copies apart;
        returns the pinned set."""
        self._unpin_all()
        for key in keys:
            if key not in self.recent:
                self.pin(key)
        return sorted(self.pinned)


class LayerLRUTier(FastTier[V]):
    """Tier 1 as one LRU per layer, each with `capacity / n_layers` bytes and no hot set: the
    mixtral-offloading design, kept as a baseline for benchmarks (`placement="stream"`).

    `put` evicts only the same layer's coldest entries; `set_hot` pins nothing.
    """

    def __init__(self, capacity_bytes: int | None, n_layers: int, **hooks: Any) -> None:
        super().__init__(capacity_bytes, max_pinned_fraction=0.0, **hooks)
        self.name = "fast(per-layer LRU)"
        self.n_layers = max(1, n_layers)

    def layer_capacity(self) -> int | None:
        """Bytes each layer's LRU may hold (None: unbounded)."""
        return None if self.capacity_bytes is None else self.capacity_bytes // self.n_layers

    def _layer_used(self, layer: int) -> int:
        return sum(size for k, (_, size) in self._items.items() if k[0] == layer)

    def fits(self, nbytes: int, key: ExpertKey | None = None) -> bool:
        cap = self.layer_capacity()
        return cap is None or nbytes <= cap

    def has_room(self, nbytes: int, key: ExpertKey | None = None) -> bool:
        cap = self.layer_capacity()
        return cap is None or key is None or self._layer_used(key[0]) + nbytes <= cap

    def victims_for(self, nbytes: int, key: ExpertKey | None = None) -> list[ExpertKey]:
        cap = self.layer_capacity()
        if cap is None or key is None:
            return super().victims_for(nbytes, key)
        need = self._layer_used(key[0]) + nbytes - cap
        out: list[ExpertKey] = []
        for k, (_, size) in self._items.items():
            if need <= 0:
                break
            if k[0] == key[0]:
                out.append(k)
                need -= size
        return out

    def resize(self, capacity_bytes: int | None) -> list[ExpertKey]:
        evicted = super().resize(capacity_bytes)
        cap = self.layer_capacity()
        if cap is not None:  # the total may hold while one layer is over its share
            for layer in sorted({k[0] for k in self._items}):
                while self._layer_used(layer) > cap:
                    victim = next(k for k in self._items if k[0] == layer)
                    self._drop(victim)
                    evicted.append(victim)
        return evicted

    def set_hot(self, keys: list[ExpertKey]) -> list[ExpertKey]:
        """No hot set in this design."""
        self._unpin_all()
        return []
