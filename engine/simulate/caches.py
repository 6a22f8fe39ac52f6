"""The cache policies a replay and the bound compare with, fed one step's keys at a time.

A step is one (step, MoE layer) of a replay (or one record of `stats.trace_stats`): its distinct
integer keys, all resident together while it runs. Each cache answers `missing(keys)`: the keys
of this step it did not hold, loaded now (the others it held are touched); a cache never evicts a
key of the step it is serving (a step wider than the cache overfills it while it runs: a prefill
step may route more experts than tier 1 holds). State is bounded by the cache's capacity, not
the trace's length, so a trace can be streamed through them:

- `LRUCache`: evict the least recently used (ties within a step: the earlier key).
- `BeladyCache`: the offline optimum, evict the key whose next use is farthest (never used again:
  farthest of all; ties: the lower key). It needs the future: `NextUses`, one pass over the keys
  first, keeps the next use of every key occurrence as one C int (4 bytes; 8 past 2**31 - 1
  steps). That array is the only state that grows with the trace.
- `LoadFill`: a cache's misses as if it had been filled before the first step with the first
  `capacity` distinct keys the steps use (`stats.filled_at_load`).
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from ..errors import EngineError

_INT_MAX = 2**31 - 1


class NextUses:
    """For every key occurrence, in step order, the index of the next step that uses the same key
    (`steps`, the number of steps, if none): what `BeladyCache` looks ahead with. Built one step at
    a time (`add`, then `done`), so the keys themselves are never held. Also counts the distinct
    keys (`keys`) and the widest step (`widest`)."""

    def __init__(self) -> None:
        self.at: array[int] = array("i")  # C int: 4 bytes an occurrence
        self.steps = 0
        self.widest = 0
        self._last: dict[int, int] = {}  # key -> its latest occurrence (bounded by distinct keys)
        self._done = False

    @classmethod
    def of(cls, steps: Iterable[Sequence[int]]) -> NextUses:
        uses = cls()
        for keys in steps:
            uses.add(keys)
        uses.done()
        return uses

    def add(self, keys: Sequence[int]) -> None:
        """The next step's keys."""
        i, at, last = self.steps, self.at, self._last
        if i == _INT_MAX and at.typecode == "i":  # a step index past a C int: widen, once
            self.at = at = array("q", at)
        for k in keys:
            p = last.get(k)
            if p is not None:
                at[p] = i
            last[k] = len(at)
            at.append(-1)
        self.steps += 1
        self.widest = max(self.widest, len(keys))

    def done(self) -> None:
        """Every step added: an occurrence never used again is due at `steps` (as far as any)."""
        if not self._done:
            view = np.frombuffer(self.at, dtype=np.intc if self.at.typecode == "i" else np.int64)
            view[view < 0] = self.steps
            self._done = True

    @property
    def keys(self) -> int:
        """How many distinct keys the steps use."""
        return len(self._last)


class CacheError(EngineError, ValueError):
    """Keys fed to a `BeladyCache` that are not the ones its `NextUses` was built from."""


class BeladyCache:
    """Belady's offline optimum of `capacity` keys over the steps `uses` was built from, fed those
    steps in order (module docstring). Holds at most `capacity` keys and a heap kept within twice
    their number (stale entries dropped when it grows past that)."""

    def __init__(self, uses: NextUses, capacity: int) -> None:
        uses.done()
        self.uses, self.capacity = uses, capacity
        self._at = 0
        self._due: dict[int, int] = {}  # cached key -> the step of its next use
        self._heap: list[tuple[int, int]] = []  # (-next use, key), stale entries skipped

    def missing(self, keys: Sequence[int]) -> list[int]:
        due, heap = self._due, self._heap
        missing = [k for k in keys if k not in due]
        # Own hits are due now (this step), every other entry later: they are never the farthest.
        for _ in range(len(due) + len(missing) - max(self.capacity, len(keys))):
            while True:
                neg, k = heapq.heappop(heap)
                if due.get(k) == -neg:
                    del due[k]
                    break
        start, self._at = self._at, self._at + len(keys)
        nexts = self.uses.at[start : self._at]
        if len(nexts) != len(keys):
            raise CacheError(
                f"{start + len(keys)} keys fed where the next uses were counted over {len(self.uses.at)}"
            )
        for k, nxt in zip(keys, nexts, strict=True):
            due[k] = nxt
            heapq.heappush(heap, (-nxt, k))
        if len(heap) > 2 * len(due) + 64:
            # Only each key's latest entry is live (a key's next uses only grow): the same
            # evictions from a heap of those alone, and the heap stays within the cache's size.
            self._heap = [(-nxt, k) for k, nxt in due.items()]
            heapq.heapify(self._heap)
        return missing


class LRUCache:
    """An LRU cache of `capacity` keys (module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._cache: OrderedDict[int, None] = OrderedDict()

    def missing(self, keys: Sequence[int]) -> list[int]:
        cache = self._cache
        missing = []
        for k in keys:
            if k in cache:
                cache.move_to_end(k)
            else:
                missing.append(k)
        for _ in range(len(cache) + len(missing) - max(self.capacity, len(keys))):
            cache.popitem(last=False)  # own hits were just moved to the end: never evicted
        for k in missing:
            cache[k] = None
        return missing


class LoadFill:
    """A cache's misses (`kept`, one step's at a time) for the same cache filled before the first
    step, untimed, with the first `capacity` distinct keys the steps use, whose first misses go
    (`stats.filled_at_load` says why that is exact for Belady and LRU)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._seen: set[int] = set()

    def kept(self, missing: Sequence[int]) -> list[int]:
        seen, kept = self._seen, []
        for k in missing:
            if len(seen) < self.capacity and k not in seen:
                seen.add(k)
            else:
                kept.append(k)
        return kept
