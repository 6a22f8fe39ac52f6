"""The all-hit tiered layer (issue 61): a decode layer whose routed experts are all in tier 1 is
found by one lookup over the layer's row of tier 1 (`FastTier.hits`), with the frequency and
recency updates done as C-level calls, and computes the same bits as the resident store."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from freetoken_agents.engine.ftw import FTWWriter
from freetoken_agents.engine.ftw.codecs import encode
from freetoken_agents.engine.memory import FastTier, MemoryBudget, TieredExpertProvider
from freetoken_agents.engine.memory.routing import RoutingFrequency
from freetoken_agents.engine.model.experts import ExpertWeights, InMemoryExpertProvider
from freetoken_agents.engine.model.moe import Router
from freetoken_agents.engine.simulate.all_hit import all_hit_overhead_us
from freetoken_agents.engine.spec import MoESpec

LAYERS, EXPERTS = 3, 8


def twin_tiers(ranked: bool, capacity: int) -> tuple[FastTier[str], FastTier[str]]:
    """Two identical tiers: one is asked with `hits`, the other with `get_all` (the reference)."""
    tiers = []
    for _ in range(2):
        rank = RoutingFrequency(range(LAYERS)) if ranked else None
        tiers.append(FastTier(capacity, rank=rank))
    return tiers[0], tiers[1]


@pytest.mark.parametrize("ranked", [False, True])
def test_hits_follow_the_tier_as_get_all_does(ranked: bool) -> None:
    """Over random puts, evictions, pops, replacements, resizes and hot-set pins, `hits` returns
    what `get_all` returns (None on any absent expert), and leaves the same order of use, counters
    and eviction choices: the row table never serves an evicted or replaced value."""
    rng = random.Random(7)
    fast, ref = twin_tiers(ranked, capacity=10)
    for step in range(3000):
        layer = rng.randrange(LAYERS)
        op = rng.random()
        if op < 0.35:
            key, size = (layer, rng.randrange(EXPERTS)), rng.choice([1, 2])
            value = f"w{step}"
            assert fast.put(key, value, size) == ref.put(key, value, size)
        elif op < 0.4:
            key = (layer, rng.randrange(EXPERTS))
            assert fast.pop(key) == ref.pop(key)
        elif op < 0.45:
            key = (layer, rng.randrange(EXPERTS))
            if key in ref:
                fast.replace(key, f"r{step}")
                ref.replace(key, f"r{step}")
        elif op < 0.48:
            cap = rng.choice([4, 8, 10, 12])
            assert fast.resize(cap) == ref.resize(cap)
        elif op < 0.5:
            hot = rng.sample(ref.keys(), k=min(3, len(ref)))
            assert fast.set_hot(hot) == ref.set_hot(hot)
        else:
            used = sorted(rng.sample(range(EXPERTS + 2), k=rng.choice([1, 2, 3])))  # ids past any held
            if ranked:  # the routing a step notes, as the provider does before the lookup
                fast.rank.note(layer, used)  # type: ignore[union-attr]
                ref.rank.note(layer, used)  # type: ignore[union-attr]
            found = fast.hits(layer, used)
            expected = ref.get_all([(layer, e) for e in used])
            assert (list(found) if found is not None else None) == expected
        # the order of use: a ranked tier's `keys` sorts by recency, which must be the LRU order
        # the reference (which moves every used key to the end) keeps
        assert fast.keys() == ref.keys() == list(ref._items)
        assert sorted(fast.held()) == sorted(ref.keys())
        assert fast.counters.hits == ref.counters.hits
        assert fast.victims_for(2) == ref.victims_for(2)


def test_hits_of_an_unknown_layer_or_no_experts() -> None:
    fast: FastTier[str] = FastTier(None)
    assert fast.hits(0, [1]) is None
    fast.put((0, 1), "a", 1)
    assert fast.hits(0, []) is None
    assert fast.hits(1, [1]) is None
    assert fast.hits(0, [1]) == ("a",)
    assert fast.counters.hits == 1


def test_routing_note_adds_as_the_loop_did() -> None:
    """`RoutingFrequency.note` (C-level update) gives the loop's counts bit for bit, for lists,
    tuples and one-pass iterables."""
    rng = random.Random(3)
    fast, ref = RoutingFrequency([0], decay=0.97), {}
    scale = 1.0
    for i in range(500):
        used = sorted(rng.sample(range(16), k=4))
        fast.note(0, iter(used) if i % 3 == 0 else (tuple(used) if i % 3 == 1 else used))
        scale *= 0.97
        for e in used:
            ref[e] = ref.get(e, 0.0) + 1.0 / scale
    assert fast.by_layer[0] == ref


def _scratch_ftw(path: Path, hidden: int, inter: int) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    with FTWWriter(path, model_config={"model_type": "test"}) as w:
        for layer in range(LAYERS):
            for e in range(EXPERTS):
                gate_up = torch.randn(2 * inter, hidden, generator=g)
                down = torch.randn(hidden, inter, generator=g)
                tensors[(layer, e)] = {"gate_up": gate_up, "down": down}
                w.add_expert(layer, e, {"gate_up": encode(gate_up, "fp32"), "down": encode(down, "fp32")})
    return tensors


@pytest.mark.parametrize("top_k", [2, 3])
def test_all_hit_decode_layer_makes_no_per_expert_call(tmp_path: Path, top_k: int) -> None:
    """With every expert in tier 1 a decode layer never asks tier 1 expert by expert (`get`,
    `get_all`) nor prices one (`decide`, `_compute`), and computes the resident store's bits."""
    hidden, inter = 32, 16
    tensors = _scratch_ftw(tmp_path / "e.ftw", hidden, inter)
    spec = MoESpec(num_experts=EXPERTS, top_k=top_k, intermediate_size=inter, routing="softmax_topk")
    routers = {layer: Router(spec, hidden).to_empty(device="cpu") for layer in range(LAYERS)}
    for router in routers.values():
        torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(1))
    packed = {k: ExpertWeights.packed(t, torch.float32, "cpu") for k, t in tensors.items()}
    resident = InMemoryExpertProvider(packed)
    tp = TieredExpertProvider(
        tmp_path / "e.ftw", MemoryBudget(), top_k=top_k, routers=routers, prefetch=True, prefetch_thread=False
    )
    try:
        for key in tp.keys():
            tp.get(*key)

        def refuse(*_a: object, **_k: object) -> None:
            raise AssertionError("per-expert call on an all-hit layer")

        tp.fast.get = refuse  # type: ignore[method-assign]
        tp.fast.get_all = refuse  # type: ignore[method-assign]
        tp.planner.decide = refuse  # type: ignore[method-assign]
        tp._compute = refuse  # type: ignore[method-assign]
        g = torch.Generator().manual_seed(2)
        hits_before = tp.fast.counters.hits
        for step in range(40):
            x = torch.randn(1, hidden, generator=g)
            ids = torch.randperm(EXPERTS, generator=g)[:top_k][None]
            w = torch.softmax(torch.randn(1, top_k, generator=g), dim=-1)
            for layer in range(LAYERS):
                with torch.inference_mode():
                    got = tp.run(layer, x, ids, w, spec)
                    want = resident.run(layer, x, ids, w, spec)
                assert torch.equal(got, want), (step, layer)
        assert tp.fast.counters.hits - hits_before == 40 * LAYERS * top_k
        assert tp.policy.stats()["decisions"] == {"resident": 40 * LAYERS * top_k}
        assert sum(tp.routing.by_layer[0].values()) > 0
    finally:
        tp.close()


def test_all_hit_measure_gives_finite_figures() -> None:
    """The measure `bench/simulate_overheads.py` prints (finite; no speed asserted)."""
    extra, resident = all_hit_overhead_us(2, experts=8, top_k=2, layers=2, rounds=2)
    assert math.isfinite(extra) and math.isfinite(resident) and resident > 0
    with pytest.raises(ValueError, match="top_k"):
        all_hit_overhead_us(2, experts=4, top_k=5)


def test_hf_folder_with_a_roomy_budget_decodes_all_hit_and_equal(tiny_checkpoint) -> None:
    """Issue 61's spelling on a tiny Mixtral: the HF folder, placement "qstar", fast 1.5x and host
    1x the experts' bytes. After warm-up every decode layer hits tier 1 (no miss, no eviction by
    the KV refits of a budget that fits everything) and the tokens equal the resident engine's."""
    from freetoken_agents.engine import Engine
    from freetoken_agents.engine.loading.placement import expert_bytes

    folder = tiny_checkpoint("mixtral")
    resident = Engine.from_pretrained(folder, dtype=torch.float32)
    x = expert_bytes(resident.model.spec, torch.float32)
    tiered = Engine.from_pretrained(
        folder,
        dtype=torch.float32,
        placement="qstar",
        memory=MemoryBudget(fast_bytes=int(1.5 * x), host_bytes=x),
    )
    try:
        prompt = [1, 5, 9, 2, 7, 3]

        def greedy(engine: Engine, n: int = 24) -> list[int]:
            with engine.new_session() as s:
                tok = int(s.prefill(prompt, last_only=True)[0].argmax())
                out = [tok]
                for _ in range(n - 1):
                    tok = int(s.prefill([tok], last_only=True)[0].argmax())
                    out.append(tok)
            return out

        greedy(tiered)  # warm-up round
        fast = tiered.experts.fast
        misses, evictions = fast.counters.misses, fast.counters.evictions
        assert greedy(tiered) == greedy(resident)
        assert (fast.counters.misses, fast.counters.evictions) == (misses, evictions)
        assert len(fast) == len(tiered.experts.keys())
    finally:
        tiered.close()
