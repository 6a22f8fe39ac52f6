"""The decayed routing frequency that ranks experts for every tier and values residency for q*."""

from __future__ import annotations

from freetoken_agents.engine.memory import ROUTING_DECAY
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
