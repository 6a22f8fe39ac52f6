"""Byte-budgeted expert tiers: an LRU with counters and the host tier (one LRU shared by every
layer); tier 1's classes, on this LRU, are in `fast_tier`.

What a tier holds depends on the machine (see `provider.py`): on CUDA tier 1 holds device tensors
and tier 2 pinned host tensors; on a CPU-only machine tier 1 holds decoded `ExpertWeights` ready
for matmul and tier 2 the stored FTW block bytes. The tiers only count bytes and order keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, Generic, TypeVar

from ..model.experts import ExpertKey
from .ranked import LayeredRank, RankedKeys, RankedOrder

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class TierCounters:
    """Counters of one tier. `bytes_in`/`bytes_out`: bytes inserted / evicted (not hits)."""

    hits: int = 0
    misses: int = 0
    inserts: int = 0
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    shrinks: int = 0  # capacity reductions (KV pressure)
    regrows: int = 0  # capacity increases

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class LRUTier(Generic[K, V]):
    """Keys (`K`) -> values (`V`) with a byte size, least recently used first, under `capacity_bytes`.

    Pinned keys are never chosen by `put`'s evictions; `resize` evicts unpinned keys coldest first
    and only then pinned ones (coldest first). `capacity_bytes=None` means unbounded.
    Hooks, given at construction (subclasses pass them on as `**hooks`):
    - `on_evict` (if set) is called with each evicted key and value (not for `pop`);
    - `protected` (if set) names keys needed soon (the next layers' predicted experts): `put`
      evicts them only when the other unpinned keys do not free enough room;
    - `rank` (if set) orders evictions: lowest rank first, least recently used first among equal
      ranks (unset: plain LRU). A `ranked.LayeredRank` (the routing frequencies) is kept in one
      lazy heap per layer (`ranked.RankedKeys`); any other rank sorts the tier per eviction.
    """

    def __init__(
        self,
        name: str,
        capacity_bytes: int | None,
        *,
        on_evict: Callable[[K, V], None] | None = None,
        protected: Callable[[K], bool] | None = None,
        rank: Callable[[K], float] | None = None,
    ) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.counters = TierCounters()
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.pinned: set[K] = set()  # change it through _pin / _unpin / _unpin_all only
        self._pinned_bytes = 0  # their bytes, kept as they change: every tier-1 miss asks
        self.on_evict = on_evict
        self.protected = protected  # needed soon: evicted last
        self.rank = rank  # eviction order (lowest first)
        # With a layered rank: key -> recency (larger: more recent), and the heaps over it.
        self._recency: dict[K, int] = {}
        self._tick = 0
        self._ranked = RankedKeys(rank, self._recency) if isinstance(rank, LayeredRank) else None  # type: ignore[arg-type]

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[K]:
        """Keys, coldest (least recently used) first."""
        return list(self._items)

    def eviction_order(self) -> Iterable[K]:
        """Keys in the order evictions take them: by `rank` (stable, so least recently used first
        among equals), or least recently used first without one. Without a rank this iterates
        the tier lazily (no copy): evictions look at the first few keys only, and a tier 1 of
        thousands of experts was copied whole for every miss. Do not change the tier while
        iterating."""
        if self.rank is None:
            return iter(self._items)
        if self._ranked is not None and self.rank is self._ranked.rank:
            return self._ranked.order()  # close() it before the tier changes
        return sorted(self._items, key=self.rank)

    def _touch(self, key: K) -> None:
        """`key` is now the most recently used (the layered rank's recency)."""
        if self._ranked is not None:
            self._tick += 1
            self._recency[key] = self._tick

    def _forget(self, key: K) -> None:
        if self._ranked is not None:
            del self._recency[key]
            self._ranked.discard(key)  # type: ignore[arg-type]

    def _pin(self, key: K) -> None:
        if key not in self.pinned:
            self.pinned.add(key)
            self._pinned_bytes += self._items[key][1]

    def _unpin(self, key: K) -> None:
        if key in self.pinned:
            self.pinned.discard(key)
            self._pinned_bytes -= self._items[key][1]

    def _unpin_all(self) -> None:
        self.pinned.clear()
        self._pinned_bytes = 0

    def get(self, key: K, *, count: bool = True) -> V | None:
        """The value (marked most recently used) or None; counts a hit or a miss."""
        item = self._items.get(key)
        if item is None:
            if count:
                self.counters.misses += 1
            return None
        self._items.move_to_end(key)
        self._touch(key)
        if count:
            self.counters.hits += 1
        return item[0]

    def get_all(self, keys: list[K]) -> list[V] | None:
        """The values of every key in `keys` (each marked most recently used, each a hit), or
        None, touching nothing, when any is absent: one call for a layer whose routed experts
        are all resident (the caller then goes key by key)."""
        items = self._items
        found = [item[0] for k in keys if (item := items.get(k)) is not None]
        if len(found) != len(keys):
            return None
        for k in keys:
            items.move_to_end(k)
            self._touch(k)
        self.counters.hits += len(keys)
        return found

    def peek(self, key: K) -> V | None:
        """The value without touching recency or counters."""
        item = self._items.get(key)
        return None if item is None else item[0]

    def replace(self, key: K, value: V) -> None:
        """Give a held `key` a new value (same bytes, same place in the order; not counted)."""
        _, size = self._items[key]
        self._items[key] = (value, size)

    def fits(self, nbytes: int, key: K | None = None) -> bool:
        """Whether `nbytes` (for `key`) could be held at all (pinned bytes cannot be evicted by
        `put`). `key` matters only to tiers that partition capacity (`LayerLRUTier`)."""
        if self.capacity_bytes is None:
            return True
        return nbytes <= self.capacity_bytes - self.pinned_bytes()

    def has_room(self, nbytes: int, key: K | None = None) -> bool:
        """Whether `nbytes` (for `key`) fit without evicting anything."""
        return self.capacity_bytes is None or self.used_bytes + nbytes <= self.capacity_bytes

    def victims_for(self, nbytes: int, key: K | None = None) -> list[K]:
        """The unpinned keys `put(key, …, nbytes)` would evict (no change made): coldest first,
        keys `protected` says are needed soon only when the others do not free enough."""
        if self.capacity_bytes is None:
            return []
        need = self._over(nbytes)
        if need <= 0:  # before the order: a ranked order sorts every key, and filling a tier
            return []  # sorted it on each put (3,000 puts: 4.5 M rank calls, 0.5 s)
        out: list[K] = []
        protected = self.protected
        for second_pass in (False, True):
            order = self.eviction_order()
            try:
                for k in order:
                    if need <= 0:
                        return out
                    if k in self.pinned or k in out or self._kept_apart(k):
                        continue
                    if not second_pass and protected and protected(k):
                        continue
                    out.append(k)
                    need -= self._items[k][1]
            finally:
                if isinstance(order, RankedOrder):
                    order.close()
            if protected is None:
                break
        return out

    def put(self, key: K, value: V, nbytes: int) -> list[K]:
        """Insert as most recently used, evicting unpinned keys coldest first; returns them.

        Returns [] and inserts nothing when `nbytes` cannot fit beside the pinned set.
        """
        if key in self._items:
            self._items.move_to_end(key)
            self._touch(key)
            return []
        if not self.fits(nbytes, key):
            return []
        evicted = self.victims_for(nbytes, key)
        for victim in evicted:
            self._drop(victim)
        self._insert(key, value, nbytes)
        return evicted

    def _insert(self, key: K, value: V, nbytes: int) -> None:
        """Hold `key` as the most recently used (room already made)."""
        self._items[key] = (value, nbytes)
        if self._ranked is not None:
            self._touch(key)
            self._ranked.add(key)  # type: ignore[arg-type]
        self.used_bytes += nbytes
        self.counters.inserts += 1
        self.counters.bytes_in += nbytes

    def pop(self, key: K) -> V | None:
        """Remove `key` (not counted as an eviction); returns its value."""
        if key not in self._items:
            return None
        self._unpin(key)
        item = self._items.pop(key)
        self._forget(key)
        self.used_bytes -= item[1]
        return item[0]

    def _drop(self, key: K) -> None:
        self._unpin(key)
        value, size = self._items.pop(key)
        self._forget(key)
        self.used_bytes -= size
        self.counters.evictions += 1
        self.counters.bytes_out += size
        if self.on_evict is not None:
            self.on_evict(key, value)

    def evict_coldest(self, *, include_pinned: bool = False) -> K | None:
        """Evict the first unpinned key of `eviction_order` (or pinned, if none and allowed)."""
        victim = first_pinned = None
        order = self.eviction_order()  # closed before the drop: the tier must not change under it
        try:
            for key in order:
                if self._kept_apart(key):
                    continue
                if key not in self.pinned:
                    victim = key
                    break
                if first_pinned is None:
                    first_pinned = key
        finally:
            if isinstance(order, RankedOrder):
                order.close()
        if victim is None and include_pinned:
            victim = first_pinned
        if victim is not None:
            self._drop(victim)
        return victim

    def resize(self, capacity_bytes: int | None) -> list[K]:
        """Set the capacity; evict (unpinned coldest first, pinned last) until it holds. Returns
        the evicted keys."""
        old = self.capacity_bytes
        self.capacity_bytes = capacity_bytes
        if old is not None and (capacity_bytes is None or capacity_bytes > old):
            self.counters.regrows += 1
        elif capacity_bytes is not None and (old is None or capacity_bytes < old):
            self.counters.shrinks += 1
        evicted: list[K] = []
        while capacity_bytes is not None and self.used_bytes > capacity_bytes:
            key = self.evict_coldest(include_pinned=True)
            if key is None:
                break
            evicted.append(key)
        return evicted

    def pinned_bytes(self) -> int:
        return self._pinned_bytes

    def _over(self, nbytes: int) -> int:
        """Bytes a `put` of `nbytes` must evict (<= 0: none)."""
        assert self.capacity_bytes is not None
        return self.used_bytes + nbytes - self.capacity_bytes

    def _kept_apart(self, key: K) -> bool:
        """Whether `key` is outside what `put` and `resize` evict (tier 1's recent copies)."""
        return False

    def stats(self) -> dict[str, int | None]:
        return {
            **self.counters.as_dict(),
            "entries": len(self._items),
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "pinned": len(self.pinned),
        }


class HostTier(LRUTier[ExpertKey, V]):
    """Tier 2: one LRU shared by all layers (a hot layer may take the whole tier)."""

    def __init__(self, capacity_bytes: int | None, **hooks: Any) -> None:
        super().__init__("host", capacity_bytes, **hooks)
