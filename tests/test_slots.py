"""Expert slots (engine/memory/slots.py): a device buffer of packed experts, a device-side table
expert -> slot, and one grouped GEMM per projection over the slots. Run on CPU here; the same
code runs on a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from freetoken_agents.engine.memory.slots import ExpertSlots, SlotsFullError
from freetoken_agents.engine.model.experts import ExpertWeights, dispatch_experts, expert_forward
from freetoken_agents.engine.model.grouped_experts import compact_weight
from freetoken_agents.engine.spec import MoESpec

H, INTER = 32, 24
COMPACT_INTER = 32


def _expert(seed: int, bias: bool = False, inter: int = INTER) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    t = {"gate_up": torch.randn(2 * inter, H, generator=g), "down": torch.randn(H, inter, generator=g)}
    if bias:
        t["gate_up_bias"] = torch.randn(2 * inter, generator=g)
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
    int8 = ExpertWeights.quantized(_expert(0).tensors(), torch.float32)
    with pytest.raises(ValueError, match="not laid out like"):
        slots.assign((0, 1), int8)
    mixed = ExpertWeights.packed_mixed({**int8.tensors(), "down": _expert(0).down, "down_scale": None})
    with pytest.raises(ValueError, match="share one form"):
        ExpertSlots(mixed, 2, 1, 2, "cpu")


def test_each_slot_tensor_starts_aligned_for_the_grouped_gemm():
    """A GPU's grouped GEMM wants 16-byte aligned strides: rows and tensors start at multiples of
    128 bytes whatever the expert's sizes (here odd ones, with biases)."""
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
    assert slots.row % 128 == 0
    for t in (slots.stack.gate_up, slots.stack.down, slots.stack.gate_up_bias, slots.stack.down_bias):
        assert t.stride(0) * 4 % 128 == 0 and (t.data_ptr() - slots.buffer.data_ptr()) % 128 == 0
    view = slots.assign((0, 1), odd)
    for name, t in odd.tensors().items():
        assert torch.equal(getattr(view, name), t)


def _compact(seed: int, codec: str, bias: bool = False) -> ExpertWeights:
    """An int8 or MXFP4 expert (the forms tier 1 keeps compact), optionally with float biases;
    intermediate size `COMPACT_INTER` (MXFP4 blocks are 32 inputs)."""
    t = _expert(seed, bias, COMPACT_INTER).tensors()
    for name in ("gate_up", "down"):
        t[name], t[f"{name}_scale"], _ = compact_weight(t[name], codec)  # type: ignore[arg-type]
    return ExpertWeights.packed_mixed(t)


def _dequantized(w: ExpertWeights) -> ExpertWeights:
    """A compact expert's values as fp32 (the CPU's int8 kernel rounds activations to bf16, so the
    per-expert loop is no exact reference for the interpreter's fp32 GEMVs)."""
    from freetoken_agents.engine.kernels.mxfp4 import decode_weight

    t = w.tensors()
    for name in ("gate_up", "down"):
        scale = t.pop(f"{name}_scale")
        q = t[name]
        t[name] = (
            decode_weight(q, scale, torch.float32) if q.dtype == torch.uint8 else q.float() * scale[:, None]
        )
    return ExpertWeights(**t)


@pytest.mark.parametrize("codec", ["int8", "mxfp4"])
def test_compact_experts_take_slots_of_their_own_layout(codec):
    """An int8 or MXFP4 expert lives in a slot as its stored bytes (weights, scales and biases each
    in its own dtype at an aligned byte offset); the stack views them per slot, and the
    per-expert loop over the slot's views gives the bits of the expert it was copied from."""
    spec = MoESpec(4, 2, COMPACT_INTER, "softmax_topk", activation="swiglu_clamped")  # type: ignore[arg-type]
    experts = {(0, e): _compact(e, codec, bias=True) for e in range(4)}
    slots = ExpertSlots(experts[(0, 0)], capacity=4, num_layers=1, num_experts=4, device="cpu")
    for key in [(0, 2), (0, 0), (0, 3), (0, 1)]:
        view = slots.assign(key, experts[key])
        for name, t in experts[key].tensors().items():
            got = getattr(view, name)
            assert got.dtype == t.dtype and torch.equal(got, t), name
            assert (got.data_ptr() - slots.buffer.data_ptr()) % 128 == 0
    assert slots.stack.codec == codec and slots.row % 128 == 0
    slot = slots.slot_of((0, 3))
    assert torch.equal(slots.stack.gate_up_scale[slot], experts[(0, 3)].gate_up_scale)
    hidden = torch.randn(1, H, generator=torch.Generator().manual_seed(3))
    ids, weights = torch.tensor([[3, 1]]), torch.tensor([[0.75, 0.25]])
    want = dispatch_experts(lambda e, x: expert_forward(experts[(0, e)], x, spec), hidden, ids, weights)
    held = {e: slots.weights(slots.slot_of((0, e))) for e in range(4)}
    got = dispatch_experts(lambda e, x: expert_forward(held[e], x, spec), hidden, ids, weights)
    assert torch.equal(got, want)


_COMPACT_RUN = textwrap.dedent(
    """
    import torch
    from test_slots import H, _compact, _dequantized
    from freetoken_agents.engine.model.experts import dispatch_experts, expert_forward
    from freetoken_agents.engine.memory.slots import ExpertSlots
    from freetoken_agents.engine.spec import MoESpec

    for codec in ("int8", "mxfp4"):
        for bias, act in ((False, "silu"), (True, "swiglu_clamped")):
            spec = MoESpec(6, 2, 32, "softmax_topk", activation=act)
            experts = {(1, e): _compact(e, codec, bias) for e in range(6)}
            floats = {k: _dequantized(w) for k, w in experts.items()}  # exact fp32 reference
            slots = ExpertSlots(experts[(1, 0)], capacity=8, num_layers=2, num_experts=6, device="cpu")
            for key in [(1, 4), (1, 0), (1, 2), (1, 5), (1, 1)]:
                slots.assign(key, experts[key])
            g = torch.Generator().manual_seed(9)
            for t in (1, 3):
                hidden = torch.randn(t, H, generator=g)
                ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(t)])
                ids[ids == 3] = 5
                weights = torch.rand(t, 2, generator=g)
                out, miss = slots.run(1, hidden, ids, weights, spec)
                ref = lambda e, x: expert_forward(floats[(1, e)], x, spec)
                want = dispatch_experts(ref, hidden, ids, weights)
                assert not bool(miss)
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
            _, miss = slots.run(1, hidden, torch.tensor([[3, 0]]).expand(t, 2), weights, spec)
            assert bool(miss)
    print("ok")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_compact_slots_run_as_grouped_gemvs_under_the_interpreter():
    """A layer's routed int8 / MXFP4 experts in slots run as the grouped Triton GEMVs (what a GPU
    decode step and its CUDA graph run), through Triton's interpreter here: the per-expert
    loop's values, and the miss flag for an absent expert."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parent)}
    done = subprocess.run(
        [sys.executable, "-c", _COMPACT_RUN], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
