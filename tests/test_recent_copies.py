"""Tier 1's recent segment: staged copies kept for a token or two, sized by what they are worth
against the LRU's coldest experts (`engine/memory/recent.py`)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from freetoken_agents.engine.memory import FastTier
from freetoken_agents.engine.memory.recent import GROW_MARGIN, RecentCopies
from freetoken_agents.engine.memory.routing import RoutingFrequency
from freetoken_agents.engine.memory.routing_trace import group_steps
from freetoken_agents.engine.simulate.profiles import load_profile
from freetoken_agents.engine.simulate.replay import TieredReplay
from freetoken_agents.engine.simulate.shapes import shape_for
from freetoken_agents.engine.simulate.synthetic import (
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    preset_trace,
)


def tier(capacity: int, keys: list[tuple[int, int]]) -> FastTier[str]:
    fast: FastTier[str] = FastTier(capacity)
    for key in keys:
        fast.put(key, "w", 1)
    return fast


def test_the_recent_segment_evicts_only_its_own_oldest_and_put_never_takes_it() -> None:
    evicted: list[tuple[int, int]] = []
    fast: FastTier[str] = FastTier(6, on_evict=lambda k, _v: evicted.append(k))
    for e in range(6):
        fast.put((0, e), "w", 1)
    assert fast.set_recent_capacity(2) == [(0, 0), (0, 1)]  # the LRU gave up two, coldest first
    assert fast.put_recent((1, 0), "r", 1) == [] and fast.put_recent((1, 1), "r", 1) == []
    assert fast.put_recent((1, 2), "r", 1) == [(1, 0)]  # its own oldest, not the LRU's
    assert fast.get((1, 1)) == "r"  # a kept copy is a hit like any resident
    assert fast.put_recent((1, 3), "r", 1) == [(1, 2)]  # (1, 1) was just used
    assert fast.put((0, 9), "w", 1) == [(0, 2)]  # the LRU's own coldest, never a kept copy
    assert not fast.has_room(1) and fast.fits(4) and not fast.fits(5)
    assert list(fast.recent) == [(1, 1), (1, 3)] and len(fast) == 6
    stats = fast.stats()
    assert (stats["recent_capacity_bytes"], stats["recent_bytes"], stats["recent"]) == (2, 2, 2)
    assert stats["entries"] == 6 and stats["used_bytes"] == 6
    assert fast.set_recent_capacity(0) == [(1, 1), (1, 3)]
    assert fast.has_room(2)
    assert fast.put_recent((1, 4), "r", 1) is None and (1, 4) not in fast  # no room: not kept
    assert evicted == [(0, 0), (0, 1), (1, 0), (1, 2), (0, 2), (1, 1), (1, 3)]


def test_uses_of_copies_kept_or_let_go_are_counted_at_their_depth() -> None:
    """A segment of X copies would hit the uses at depths under X: the copies used since."""
    fast = tier(8, [(0, e) for e in range(6)])
    fast.depth_limit = 3
    for e in range(4):
        fast.let_go((1, e))  # copies 1-4; the first is forgotten (3 remembered)
    assert fast.get((1, 0)) is None and not fast.depth_hits
    assert fast.get((1, 1)) is None and fast.depth_hits == {2: 1}
    assert fast.get((1, 1)) is None and fast.depth_hits == {2: 1}  # counted once, then forgotten
    fast.set_recent_capacity(2)
    fast.depth_limit = 8
    fast.put_recent((2, 0), "r", 1)  # copy 5
    fast.put_recent((2, 1), "r", 1)  # 6
    assert fast.get((2, 0)) == "r"  # a kept copy's hit, 1 copy since; now copy 7
    assert fast.depth_hits == {2: 1, 1: 1}
    assert fast.put_recent((2, 2), "r", 1) == [(2, 1)]  # 8; the oldest went
    assert fast.get((2, 1)) is None  # a miss on a copy that left the segment, at depth 8 - 6
    assert fast.depth_hits == {2: 2, 1: 1}
    assert fast.get_all([(2, 2), (0, 5)]) is not None and fast.depth_hits == {2: 2, 1: 1, 0: 1}


def test_the_hot_set_and_a_smaller_tier_leave_the_recent_copies_apart() -> None:
    fast = tier(6, [(0, e) for e in range(4)])
    fast.set_recent_capacity(2)
    fast.put_recent((1, 0), "r", 1)
    fast.put_recent((1, 1), "r", 1)
    assert fast.set_hot([(1, 0), (0, 3)]) == [(0, 3)]
    assert fast.resize(1) == [(1, 0), (0, 0), (0, 1), (0, 2), (0, 3)]  # the pinned one last
    assert fast.recent_capacity == 1 and list(fast.recent) == [(1, 1)] and len(fast) == 1


def test_the_rate_of_a_frequency_is_not_read_low_before_its_decay_has_filled() -> None:
    """The steady state's rate, count x (1 - d), read an expert used at every step as used at
    0.15 of them after 16 steps: the recent segment then took its room from used experts."""
    freq = RoutingFrequency([0, 1])
    for step in range(16):
        freq.note(0, [0, 1] if step % 2 else [0])
    assert freq.rate((0, 0)) == pytest.approx(1.0)
    assert freq.rate((0, 1)) == pytest.approx(0.5, abs=0.05)
    assert freq.rate((1, 0)) == 0.0  # a layer never noted


def sized(hist: dict[int, int], *, now: int = 0, keep_s: float = 0.0) -> tuple[FastTier[str], int]:
    """One sizing of a segment of `now` copies after a window of 4 steps with the uses `hist` (by
    depth), 12 copies staged in it, the LRU's experts each used at 0.5 a step (2 a window) and a
    miss worth 1 s; returns the tier and its segment after."""
    routing = RoutingFrequency([0])
    fast = tier(20, [(0, e) for e in range(12)])
    for _ in range(200):  # experts 0-11 at 0.5 a step each (fractional counts: expected uses)
        routing.note(0, [])
        for e in range(12):
            routing.by_layer[0][e] = routing.by_layer[0].get(e, 0.0) + 0.5 / routing.scale(0)
    recent = RecentCopies(
        fast, routing, slot_bytes=1, top_k=2, floor_bytes=8, window=4, miss_s=lambda: 1.0, keep_s=keep_s
    )
    fast.set_recent_capacity(now)
    for _ in range(3):
        recent.step()
    fast.depth_hits = Counter(hist)
    recent.staged = 12
    recent.step()
    return fast, fast.recent_capacity


def test_the_segment_takes_the_size_its_hits_were_worth_against_the_lru_and_its_keeps() -> None:
    assert GROW_MARGIN == 2.0
    # Two more copies: 9 hits at depths 0-1 against 2 x the 4 uses of the LRU's two coldest.
    assert sized({0: 5, 1: 4})[1] == 2
    assert sized({0: 4, 1: 4})[1] == 0  # not by the margin
    assert sized({0: 5, 1: 4}, keep_s=0.1)[1] == 0  # 12 keeps at 0.1 s cost more than it gains
    assert sized({0: 3}, now=4)[1] == 0  # 4 slots back to the LRU: 8 uses against 3 hits
    assert sized({0: 3, 3: 6}, now=4)[1] == 4  # its oldest copies earn their room
    assert sized({11: 100, 12: 100})[1] == 12  # as far as the LRU's floor (8 of 20), no further
    fast, _ = sized({})
    assert fast.depth_limit == 12 and not fast.depth_hits
    unbounded: FastTier[str] = FastTier(None)
    recent = RecentCopies(unbounded, RoutingFrequency([0]), slot_bytes=1, top_k=2, floor_bytes=8, window=1)
    recent.step()  # a tier 1 that holds every expert has nothing to give the segment
    assert unbounded.recent_capacity == 0


def test_a_copy_is_kept_only_with_room_and_the_lru_keeps_its_floor() -> None:
    fast = tier(10, [(0, e) for e in range(4)])
    fast.depth_limit = 4
    recent = RecentCopies(fast, RoutingFrequency([0]), slot_bytes=1, top_k=2, floor_bytes=4, window=4)
    assert not recent.keep((1, 0)) and list(fast.copies) == [(1, 0)]  # let go, remembered
    fast.set_recent_capacity(2)
    assert recent.keep((1, 1)) and recent.staged == 2
    fast.put_recent((1, 1), "r", 1)
    assert fast.resize(5) == [(0, 0)]  # the KV cache took tier 1's room: the LRU gives first
    assert recent.fit() == [] and fast.recent_capacity == 1  # then the segment, to the LRU's floor
    assert list(fast.recent) == [(1, 1)] and fast.capacity_bytes - fast.recent_capacity == 4


def _replay(params, model: str, tokens: int, *, keep: bool) -> tuple[TieredReplay, float]:
    shape = shape_for(model)
    # The engine's bookkeeping priced at 0 (a built-in profile charges its measured costs since
    # issue 62, at which a kept copy's tier moves cost more than its hits save: the segment closes).
    free = dict(tier_overhead_us=0.0, miss_overhead_us=0.0, stream_overhead_us=0.0)
    replay = TieredReplay(
        shape,
        dataclasses.replace(load_profile("rtx4090-pcie4"), **free),
        codec="mxfp4",
        fast_bytes=shape.total_expert_bytes("mxfp4") // 2,
        host_bytes=None,
    )
    if not keep:
        replay.planner.recent = None
    tally = replay.run(group_steps(preset_trace(params, tokens=tokens, seed=0)))
    return replay, tally.fast_misses / tally.tokens


def test_replayed_qwen3_keeps_staged_copies_and_misses_less_while_mixtral_keeps_none() -> None:
    """Qwen3-30B-A3B's layers route a just-used expert again 3.5x as often as chance (the
    preset's reuse: 21.9% against 6.25%), so copies are worth keeping; Mixtral's
    LRU experts are used nearly as often as a kept copy would be, so its segment stays empty."""
    qwen, with_recent = _replay(QWEN3_30B_A3B, "qwen3-30b-a3b", 128, keep=True)
    _, without = _replay(QWEN3_30B_A3B, "qwen3-30b-a3b", 128, keep=False)
    assert qwen.fast.recent_capacity > 0 and qwen.fast.recent
    assert with_recent < without
    mixtral, _ = _replay(MIXTRAL_8X7B, "mixtral-8x7b", 96, keep=True)
    assert mixtral.fast.recent_capacity == 0
