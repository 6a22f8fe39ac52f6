"""Expert dispatch and the decayed routing frequency the tiered memory ranks experts by."""

from __future__ import annotations

import pytest
import torch

from freetoken_agents.engine.memory.routing import RoutingFrequency
from freetoken_agents.engine.model.experts import dispatch_experts


def test_dispatch_runs_each_expert_once_on_its_tokens_in_ascending_id():
    hidden = torch.arange(12, dtype=torch.float32).view(3, 4)  # [T=3, H=4]
    expert_ids = torch.tensor([[2, 0], [0, 1], [2, 1]])  # [T, A=2]
    weights = torch.tensor([[0.5, 0.25], [1.0, 2.0], [3.0, 4.0]])
    calls: list[tuple[int, list[float]]] = []

    def forward(expert: int, x: torch.Tensor) -> torch.Tensor:
        calls.append((expert, x[:, 0].tolist()))
        return x * (expert + 1)

    out = dispatch_experts(forward, hidden, expert_ids, weights)
    assert calls == [(0, [0.0, 4.0]), (1, [4.0, 8.0]), (2, [0.0, 8.0])]
    want = torch.stack(
        [
            hidden[0] * (0.5 * 3 + 0.25 * 1),
            hidden[1] * (1.0 * 1 + 2.0 * 2),
            hidden[2] * (3.0 * 3 + 4.0 * 2),
        ]
    )
    assert torch.equal(out, want)
    one = dispatch_experts(forward, hidden[:1], expert_ids[:1], weights[:1])  # the decode path
    assert torch.equal(one, want[:1])


def test_routing_frequency_decays_counts_and_ranks_experts():
    f = RoutingFrequency([0, 1], decay=0.5)
    f.note(0, [1, 2])
    f.note(0, [2])
    f.note(1, [3])
    assert f.of((0, 1)) == 0.5 and f.of((0, 2)) == 1.5 and f.of((1, 3)) == 1.0 and f.of((0, 7)) == 0.0
    assert f.hottest() == [(0, 2), (1, 3), (0, 1)]


@pytest.mark.parametrize("decay", [0.0, -0.1, 1.5])
def test_routing_frequency_rejects_a_decay_outside_0_1(decay):
    with pytest.raises(ValueError, match="decay"):
        RoutingFrequency([0], decay=decay)
