"""The decayed routing frequency that ranks experts for every tier and values residency for q*."""

from __future__ import annotations

import random

import pytest

from freetoken_agents.engine.memory import ROUTING_DECAY, FastTier
from freetoken_agents.engine.memory.routing import RoutingFrequency
from freetoken_agents.engine.options import TieringOptions
from freetoken_agents.engine.simulate.replay import TieredReplay


def test_residency_is_valued_over_a_hundred_steps_not_the_last_few() -> None:
    """An expert used every 4th step for 200 steps outranks one routed in the last 3 steps only
    (with the former decay of 0.9 the burst won: 2.7 against 2.5)."""
    freq = RoutingFrequency([0])
    assert freq.decay == ROUTING_DECAY == 0.99
    for step in range(200):
        freq.note(0, [0] if step % 4 == 0 else [2] if step >= 197 else [])
    assert freq.of((0, 0)) > freq.of((0, 2))
    assert freq.hottest()[0] == (0, 0)


def test_the_live_engine_and_the_replay_decay_alike() -> None:
    import inspect

    assert TieringOptions().decay == ROUTING_DECAY
    assert inspect.signature(TieredReplay).parameters["decay"].default == ROUTING_DECAY


def _reference(decay: float, notes: list[tuple[int, list[int]]]) -> dict[tuple[int, int], float]:
    """The definition: each step of a layer multiplies its counts by `decay`, then adds 1."""
    counts: dict[int, dict[int, float]] = {}
    for layer, used in notes:
        c = counts.setdefault(layer, {})
        for e in c:
            c[e] *= decay
        for e in used:
            c[e] = c.get(e, 0.0) + 1.0
    return {(lay, e): v for lay, c in counts.items() for e, v in c.items()}


def test_the_counts_are_the_decayed_counts_through_rescales() -> None:
    rng = random.Random(0)
    for decay in (0.5, 0.9, ROUTING_DECAY, 1.0):  # 0.5: rescaled every ~500 steps of a layer
        notes = [(rng.randrange(3), rng.sample(range(12), 3)) for _ in range(4000)]
        freq = RoutingFrequency(range(3), decay)
        for layer, used in notes:
            freq.note(layer, used)
        want = _reference(decay, notes)
        for key, v in want.items():
            assert freq.of(key) == pytest.approx(v, rel=1e-12, abs=1e-300), (decay, key)
        assert freq.hottest()[:5] == sorted(want, key=lambda k: (-want[k], -k[0], -k[1]))[:5]


def test_a_step_touches_only_the_experts_it_routes_to() -> None:
    """Every step of every layer multiplied all of the layer's counts (128 experts x 48 layers a
    Qwen3-30B token, ~0.25 ms); the others' entries now stay as they are."""
    freq = RoutingFrequency([0])
    freq.note(0, range(128))
    before = dict(freq.by_layer[0])
    freq.note(0, [3, 7])
    changed = {e for e, v in freq.by_layer[0].items() if before.get(e) != v}
    assert changed == {3, 7}
    assert freq.of((0, 3)) == pytest.approx(ROUTING_DECAY + 1.0) and freq.of((0, 5)) == pytest.approx(
        ROUTING_DECAY
    )


def test_the_hottest_among_given_experts_keep_the_global_order():
    """Tier 1's hot set ranks only tier 1's experts (`hottest(among)`): the same relative order as
    ranking every expert, never-routed ones left out, so `set_hot` pins the same set."""
    rng = random.Random(3)
    freq = RoutingFrequency(range(6))
    for _ in range(40):
        for lay in range(6):
            freq.note(lay, rng.sample(range(10), 2))
    among = rng.sample([(lay, e) for lay in range(6) for e in range(12)], 30)  # some never routed
    assert freq.hottest(among) == [k for k in freq.hottest() if k in set(among)]
    tier = FastTier[bool](30 * 10, max_pinned_fraction=0.5)
    for k in among:
        tier.put(k, True, 10)
    assert tier.set_hot(freq.hottest(among)) == tier.set_hot(freq.hottest())
