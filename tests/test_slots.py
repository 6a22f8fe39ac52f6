"""Expert slots (engine/slots.py): a device buffer of packed experts, a device-side table
expert -> slot, and one grouped GEMM per projection over the slots. Run on CPU here; the same
code runs on a GPU."""

from __future__ import annotations

import pytest
import torch

from freetoken_agents.engine.experts import ExpertWeights, dispatch_experts, expert_forward
from freetoken_agents.engine.slots import ExpertSlots, SlotsFullError
from freetoken_agents.engine.spec import MoESpec

H, INTER = 32, 24


def _expert(seed: int, bias: bool = False) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    t = {"gate_up": torch.randn(2 * INTER, H, generator=g), "down": torch.randn(H, INTER, generator=g)}
    if bias:
        t["gate_up_bias"] = torch.randn(2 * INTER, generator=g)
        t["down_bias"] = torch.randn(H, generator=g)
    return ExpertWeights.packed(t, torch.float32)


@pytest.mark.parametrize("bias", [False, True])
def test_slots_hold_experts_and_compute_them_as_one_grouped_gemm(bias):
    spec = MoESpec(6, 2, INTER, "softmax_topk", activation="swiglu_clamped" if bias else "silu")  # type: ignore[arg-type]
    experts = {(1, e): _expert(e, bias) for e in range(6)}
    slots = ExpertSlots(experts[(1, 0)], capacity=8, num_layers=2, num_experts=6, device="cpu")
    for key in [(1, 4), (1, 0), (1, 2), (1, 5), (1, 1), (1, 3)]:  # slots in another order than ids
        view = slots.assign(key, experts[key])
        assert torch.equal(view.gate_up, experts[key].gate_up)
    assert torch.equal(slots.stack.gate_up[slots.slot_of((1, 4))], experts[(1, 4)].gate_up)
    assert slots.table[0].eq(-1).all() and slots.table[1].ge(0).all()
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(5, H, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=g)
    out, miss = slots.run(1, hidden, ids, weights, spec)
    want = dispatch_experts(lambda e, x: expert_forward(experts[(1, e)], x, spec), hidden, ids, weights)
    assert not bool(miss)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_an_absent_expert_raises_the_miss_flag_and_a_released_slot_is_reused():
    spec = MoESpec(4, 2, INTER, "softmax_topk")  # type: ignore[arg-type]
    slots = ExpertSlots(_expert(0), capacity=2, num_layers=1, num_experts=4, device="cpu")
    slots.assign((0, 0), _expert(0))
    slots.assign((0, 1), _expert(1))
    with pytest.raises(SlotsFullError):
        slots.assign((0, 2), _expert(2))
    hidden = torch.randn(1, H)
    _, miss = slots.run(0, hidden, torch.tensor([[0, 2]]), torch.tensor([[0.5, 0.5]]), spec)
    assert bool(miss)  # expert 2 is not in a slot
    freed = slots.slot_of((0, 1))
    slots.release((0, 1))
    assert (0, 1) not in slots and int(slots.table[0, 1]) == -1
    slots.assign((0, 2), _expert(2))
    assert slots.slot_of((0, 2)) == freed
    out, miss = slots.run(0, hidden, torch.tensor([[0, 2]]), torch.tensor([[0.5, 0.5]]), spec)
    want = 0.5 * expert_forward(_expert(0), hidden, spec) + 0.5 * expert_forward(_expert(2), hidden, spec)
    assert not bool(miss)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_slots_refuse_experts_of_another_layout():
    slots = ExpertSlots(_expert(0), capacity=2, num_layers=1, num_experts=2, device="cpu")
    with pytest.raises(ValueError, match="not laid out like"):
        slots.assign((0, 1), _expert(1, bias=True))
    with pytest.raises(ValueError, match="float experts"):
        ExpertSlots(ExpertWeights.quantized(_expert(0).tensors(), torch.float32), 2, 1, 2, "cpu")


def test_each_slot_tensor_starts_aligned_for_the_grouped_gemm():
    """A GPU's grouped GEMM wants 16-byte aligned strides: rows and tensors start at multiples of
    64 elements whatever the expert's sizes (here odd ones, with biases)."""
    g = torch.Generator().manual_seed(0)
    odd = ExpertWeights.packed(
        {
            "gate_up": torch.randn(2 * 7, 5, generator=g),
            "down": torch.randn(5, 7, generator=g),
            "gate_up_bias": torch.randn(2 * 7, generator=g),
            "down_bias": torch.randn(5, generator=g),
        },
        torch.float32,
    )
    slots = ExpertSlots(odd, capacity=3, num_layers=1, num_experts=2, device="cpu")
    assert slots.row % 64 == 0
    for t in (slots.stack.gate_up, slots.stack.down, slots.stack.gate_up_bias, slots.stack.down_bias):
        assert t.stride(0) % 64 == 0 and (t.data_ptr() - slots.buffer.data_ptr()) // 4 % 64 == 0
    view = slots.assign((0, 1), odd)
    for name, t in odd.tensors().items():
        assert torch.equal(getattr(view, name), t)
