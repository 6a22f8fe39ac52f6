"""q*'s recent copies: the copies staged for a layer, kept in tier 1 for a token or two.

On CUDA a prefetch copies an expert predicted for a coming layer into the staging room, and q*
computes it from there once (STAGED) and lets the copy go. Routing comes back to what it just
used: on the published Mixtral-8x7B decode routing a layer routes 37.5% of the previous token's
experts again (25% by chance), and the Qwen3-30B-A3B preset assumes 21.9% (6.25% by chance).
A copy kept until the next token is a hit instead of another copy, or, when the link is full, of
a host computation. Kept copies live in tier 1's recent segment (`FastTier.put_recent`, oldest
out first), whose room the LRU gives up, so the one question is its size. Every `window` steps
`RecentCopies` sets it to the size X, a multiple of G (the copies staged a step, at least a
layer's top-k), that was worth most over the last window:

    value(X) = (hits(X) - margin x lost(X)) x miss_s - (keeps x keep_s if X > 0)

- hits(X): the uses of copies at depths under X (`FastTier.depth_hits`: hits on kept copies and
  misses on copies let go, each at the number of copies used since), what a segment of X copies
  would have hit;
- lost(X): the uses expected in a window of the experts the LRU gives up (growing: its coldest,
  by their routing rates, `RoutingFrequency.rate`) or gets back (shrinking: as many as cold as
  its coldest), relative to the present size; `margin` is `GROW_MARGIN` for growing and 1 for
  shrinking, so it does not swing on noise;
- keeps x keep_s: keeping a copy is not free. The compute thread puts it in tier 1 and copies
  it into a slot there (`keep_s`, measured on each keep, the replay's a STREAM's tier moves),
  where letting it go costs nothing; `miss_s`, what a hit saves, is q*'s estimate of a host
  computation of one expert.
The LRU keeps `floor_bytes` (a layer's working set).

Replayed on the calibrated traces (`freetoken simulate`, MXFP4, every built-in card, 25% and 50%
of the expert bytes) the segment holds ~70-200 copies for Qwen3-30B-A3B, whose just-used experts
come back 3.5x as often as chance, and stays empty for Mixtral-8x7B, whose LRU experts are used
nearly as often as a kept copy (1.5x chance). With the bookkeeping priced at this dev machine's Python
(`bench/simulate_overheads.py`) a keep costs Qwen3 more than its hit saves, and it stays closed.
It runs on CUDA only, where copies are staged.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..model.experts import ExpertKey
from .fast_tier import FastTier
from .ranked import RankedOrder
from .routing import RoutingFrequency

GROW_MARGIN = 2.0
"""How many times the LRU's expected uses a bigger segment's hits must be worth. A segment hit
saves a copy, and a copy saved only speeds a token when the link then stages another expert in
its place; a use the LRU loses is a miss. At 1 the Mixtral-8x7B replays on the RTX 4090 kept
copies and ran 0.9-2.0% slower (27.59 -> 27.34 tok/s at 50%, 19.44 -> 19.05 at 25%, cold); at 2
it keeps none there, and Qwen3-30B-A3B gains nearly as much (150.1 -> 154.8 at 50%; 154.7 at 1)."""


class RecentCopies:
    """Sizes tier 1's recent segment (module docstring) and says which staged copies it keeps.

    Args:
        fast: tier 1; its recent segment starts empty.
        routing: the routing frequencies that rank tier 1's LRU experts.
        slot_bytes: one copy's tier-1 bytes (the largest expert's).
        top_k: a layer's routed experts per token (the smallest step of the segment).
        floor_bytes: what the LRU keeps at least (a layer's working set).
        window: steps between two sizings (the planner's `hot_every`).
        miss_s: the seconds a miss costs (a host computation of one expert, q*'s estimate).
        keep_s: the seconds keeping a copy costs the compute thread (`observe_keep` measures it).
    """

    def __init__(
        self,
        fast: FastTier[Any],
        routing: RoutingFrequency,
        *,
        slot_bytes: int,
        top_k: int,
        floor_bytes: int,
        window: int,
        miss_s: Callable[[], float] = lambda: 0.0,
        keep_s: float = 0.0,
    ) -> None:
        self.fast, self.routing = fast, routing
        self.miss_s, self.keep_s = miss_s, keep_s
        self.slot_bytes, self.top_k = slot_bytes, max(1, top_k)
        self.floor_bytes, self.window = floor_bytes, max(1, window)
        self.group = self.top_k  # G: the sizes' step, copies staged per step (at least top-k)
        self.staged = 0  # copies used from the staging room since the last sizing
        self.steps = 0

    def keep(self, key: ExpertKey) -> bool:
        """A staged copy of `key` was just used: True if the caller keeps it (`put_recent`), else
        it is let go (and remembered: `FastTier.let_go`)."""
        self.staged += 1
        if self.fast.recent_capacity >= self.slot_bytes:
            return True
        self.fast.let_go(key)
        return False

    def observe_keep(self, seconds: float) -> None:
        """A keep took `seconds` of the compute thread (EMA)."""
        self.keep_s = seconds if not self.keep_s else 0.9 * self.keep_s + 0.1 * seconds

    def step(self) -> None:
        """A step begins: every `window` steps, size the segment from the last window (module
        docstring)."""
        self.steps += 1
        if self.steps % self.window:
            return
        self.fit()
        fast, slot = self.fast, self.slot_bytes
        hist, fast.depth_hits = fast.depth_hits, Counter()
        staged, self.staged = self.staged, 0
        group, self.group = self.group, max(self.top_k, round(staged / self.window))
        if fast.capacity_bytes is None:
            return
        most = max(0, (fast.capacity_bytes - self.floor_bytes) // slot)  # copies it may hold
        fast.depth_limit = most
        now = fast.recent_capacity // slot
        colder = [self.window * self.routing.rate(k) for k in self._coldest(most - now)]
        given = list(itertools.accumulate(colder, initial=0.0))  # given[i]: the i coldest's uses
        back = given[min(group, len(colder))] / min(group, len(colder)) if colder else 0.0
        depths = sorted(hist)
        hits, upto = [0], 0  # hits[i]: the uses at depths under the i-th size
        sizes = sorted({now, *range(0, most + 1, group)})
        for x in sizes[1:]:
            count = hits[-1]
            while upto < len(depths) and depths[upto] < x:
                count += hist[depths[upto]]
                upto += 1
            hits.append(count)
        miss, keeping = self.miss_s(), staged * self.keep_s
        best, best_value = now, -math.inf
        for x, h in zip(sizes, hits, strict=True):
            lost = GROW_MARGIN * given[min(x - now, len(colder))] if x >= now else -(now - x) * back
            value = (h - lost) * miss - (keeping if x else 0.0)
            if value > best_value + 1e-12:
                best, best_value = x, value
        if best != now:
            fast.set_recent_capacity(best * slot)

    def fit(self) -> list[ExpertKey]:
        """Shrink the segment so that the LRU keeps `floor_bytes` of tier 1 (tier 1 shrank: the
        KV cache grew); returns the copies that left."""
        cap = self.fast.capacity_bytes
        if cap is None or cap - self.fast.recent_capacity >= self.floor_bytes:
            return []
        slots = max(0, cap - self.floor_bytes) // self.slot_bytes
        return self.fast.set_recent_capacity(slots * self.slot_bytes)

    def _coldest(self, n: int) -> list[ExpertKey]:
        """The `n` experts of tier 1's LRU that growing the segment would evict first."""
        out: list[ExpertKey] = []
        order = self.fast.eviction_order()
        try:
            for key in order:
                if len(out) >= n:
                    break
                if key not in self.fast.pinned and key not in self.fast.recent:
                    out.append(key)
        finally:
            if isinstance(order, RankedOrder):
                order.close()
        return out
