"""Stacked experts and the grouped-GEMM dispatch (engine/model/grouped_experts.py) against the
expert-by-expert dispatch every other provider uses: the same bits."""

from __future__ import annotations

import pytest
import torch

from freetoken_agents.engine.model import grouped_experts
from freetoken_agents.engine.model.experts import (
    ExpertWeights,
    InMemoryExpertProvider,
    dispatch_experts,
    expert_forward,
)
from freetoken_agents.engine.model.grouped_experts import ExpertStack, run_grouped
from freetoken_agents.engine.model.routed import use_grouped
from freetoken_agents.engine.spec import MoESpec

pytestmark = pytest.mark.usefixtures("one_thread")

H, INTER = 32, 24


def _spec(experts: int, top_k: int, gpt_oss: bool = False) -> MoESpec:
    act = "swiglu_clamped" if gpt_oss else "silu"
    return MoESpec(experts, top_k, INTER, "softmax_topk", activation=act, expert_bias=gpt_oss)  # type: ignore[arg-type]


def _experts(n: int, bias: bool, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = {"gate_up": torch.randn(2 * INTER, H, generator=g), "down": torch.randn(H, INTER, generator=g)}
        if bias:
            t["gate_up_bias"] = torch.randn(2 * INTER, generator=g)
            t["down_bias"] = torch.randn(H, generator=g)
        out.append(t)
    return out


def _routing(tokens: int, experts: int, top_k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return ids, torch.rand(tokens, top_k, generator=g)


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "clamped+bias"])
@pytest.mark.parametrize("tokens", [1, 13])
def test_grouped_dispatch_equals_expert_by_expert(gpt_oss, tokens):
    """Bit for bit for many tokens. For one token the expert-by-expert path (CPU decode) folds
    each weight into the accumulation (add with alpha, one rounding) where the grouped path
    (GPU decode) multiplies, then adds: equal to rounding."""
    spec = _spec(8, 2, gpt_oss)
    tensors = _experts(8, bias=gpt_oss)
    stack = ExpertStack.stack(tensors)
    hidden = torch.randn(tokens, H, generator=torch.Generator().manual_seed(2))
    ids, weights = _routing(tokens, 8, 2)
    want = dispatch_experts(
        lambda e, x: expert_forward(ExpertWeights(**tensors[e]), x, spec), hidden, ids, weights
    )
    assert use_grouped(stack, tokens) == (tokens > 1)  # CPU decode loops over the routed experts
    got = run_grouped(stack, hidden, ids, weights, spec)
    if tokens > 1:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_resident_provider_stacks_each_layout_and_keeps_mixed_layers_per_expert():
    """Float and int8 layers are stacked (an int8 stack keeps its scales: a GPU runs it as grouped
    GEMVs, a CPU decode loops over its views); a layer of mixed experts (int8 gate_up, float
    down) is not. On CPU every layer gives the bits of the expert-by-expert loop."""
    spec = _spec(4, 2)
    float_layer = {(0, e): ExpertWeights.packed(t, torch.float32) for e, t in enumerate(_experts(4, False))}
    int8_layer = {
        (1, e): ExpertWeights.quantized(t, torch.float32) for e, t in enumerate(_experts(4, False, 3))
    }
    mixed_layer = {}
    for e, t in enumerate(_experts(4, False, 5)):
        q = ExpertWeights.quantized(t, torch.float32)
        mixed_layer[(2, e)] = ExpertWeights(gate_up=q.gate_up, gate_up_scale=q.gate_up_scale, down=t["down"])
    originals = {**float_layer, **int8_layer, **mixed_layer}
    before = {k: w.tensors() for k, w in originals.items()}
    provider = InMemoryExpertProvider(dict(originals))
    stacks = [provider.stack(layer) for layer in (0, 1, 2)]
    assert stacks[0] is not None and stacks[0].codec == "float"
    assert stacks[1] is not None and stacks[1].codec == "int8" and stacks[2] is None
    for (layer, e), w in before.items():
        view = provider.get(layer, e)
        for name, t in w.items():
            assert torch.equal(getattr(view, name), t), (layer, e, name)
        if layer < 2:  # a view, not a copy
            assert view.gate_up.data_ptr() == stacks[layer].gate_up[e].data_ptr()
    for t in (1, 5):
        hidden = torch.randn(t, H)
        ids, weights = _routing(t, 4, 2)
        for layer in (0, 1, 2):
            want = dispatch_experts(
                lambda e, x, layer=layer: expert_forward(originals[(layer, e)], x, spec), hidden, ids, weights
            )
            assert torch.equal(provider.run(layer, hidden, ids, weights, spec), want)


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "clamped+bias"])
@pytest.mark.parametrize("routed", [[5, 2], [2, 3], [7, 0]])
def test_resident_cpu_decode_of_two_experts_is_one_strided_view(routed, gpt_oss):
    """Top-2 CPU decode: both experts as one batched GEMV over a strided view of the stack, with
    the bits of the expert-by-expert loop (what the FTW and tiered providers run)."""
    spec = _spec(8, 2, gpt_oss)
    provider = InMemoryExpertProvider(
        {(0, e): ExpertWeights.packed(t, torch.float32) for e, t in enumerate(_experts(8, gpt_oss))}
    )
    stack = provider.stack(0)
    assert stack is not None and not use_grouped(stack, 1) and use_grouped(stack, 2)
    ids, weights = torch.tensor([routed]), torch.tensor([[0.7, 0.3]])
    g = torch.Generator().manual_seed(3)
    for _ in range(64):  # seeded: one random draw in five once found the pair's rounding apart
        hidden = torch.randn(1, H, generator=g) * 4
        want = dispatch_experts(
            lambda e, x: expert_forward(provider.get(0, e), x, spec), hidden, ids, weights
        )
        assert torch.equal(provider.run(0, hidden, ids, weights, spec), want)


def test_resident_cpu_decode_of_more_experts_loops_over_their_views():
    spec = _spec(8, 3)
    provider = InMemoryExpertProvider(
        {(0, e): ExpertWeights.packed(t, torch.float32) for e, t in enumerate(_experts(8, False))}
    )
    hidden = torch.randn(1, H)
    ids, weights = torch.tensor([[6, 1, 3]]), torch.tensor([[0.5, 0.3, 0.2]])
    want = dispatch_experts(lambda e, x: expert_forward(provider.get(0, e), x, spec), hidden, ids, weights)
    assert torch.equal(provider.run(0, hidden, ids, weights, spec), want)  # the same loop, same bits


def test_without_grouped_mm_the_provider_dispatches_expert_by_expert(monkeypatch):
    monkeypatch.setitem(grouped_experts._GROUPED_OK, ("cpu", torch.float32), False)
    spec = _spec(4, 2)
    tensors = _experts(4, False)
    provider = InMemoryExpertProvider(
        {(0, e): ExpertWeights.packed(t, torch.float32) for e, t in enumerate(tensors)}
    )
    stack = provider.stack(0)
    assert stack is not None and not use_grouped(stack, 3)
    hidden = torch.randn(3, H)
    ids, weights = _routing(3, 4, 2)
    want = dispatch_experts(lambda e, x: expert_forward(provider.get(0, e), x, spec), hidden, ids, weights)
    assert torch.equal(provider.run(0, hidden, ids, weights, spec), want)
