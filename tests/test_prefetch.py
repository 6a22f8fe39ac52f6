"""Pre-gating prefetch: the loader queue never reads a block twice or for nothing, and on a model
whose routing is not uniform (a planted router bias) its next-layer prediction is clearly more
precise and complete than a frequency-only predictor's."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from freetoken_agents.engine import Engine
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.memory import MemoryBudget, Prefetcher
from freetoken_agents.engine.memory.prefetch import SKIPPED
from freetoken_agents.engine.model.experts import ExpertKey
from freetoken_agents.engine.options import TieringOptions


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


class GatedLoads:
    """A loader whose load of `blocked` waits until `release()`; counts loads per key."""

    def __init__(self, blocked: ExpertKey) -> None:
        self.blocked, self.calls = blocked, Counter()
        self._gate = threading.Event()
        self.started = threading.Event()

    def __call__(self, key: ExpertKey) -> str:
        self.calls[key] += 1
        if key == self.blocked:
            self.started.set()
            assert self._gate.wait(10), "never released"
        return f"block{key}"

    def release(self) -> None:
        self._gate.set()


def test_take_waits_for_a_queued_load_instead_of_reading_the_block_twice():
    """The bug: `take` cancelled a load still queued and the caller read the block itself, while
    the loader went on to other reads: the block's read started over from zero."""
    loads = GatedLoads(blocked=(1, 0))
    pf = Prefetcher(loads, use_thread=True)
    pf.issue(1, [0, 1], skip=lambda k: False)  # (1, 0) runs and blocks; (1, 1) is queued behind
    assert loads.started.wait(10)
    pf.begin_layer(1, [0, 1])
    threading.Timer(0.05, loads.release).start()
    assert pf.take((1, 1)) == "block(1, 1)"
    assert pf.take((1, 0)) == "block(1, 0)"
    assert loads.calls == {(1, 0): 1, (1, 1): 1}
    assert pf.counters.taken == 2 and pf.counters.cancelled == 0
    pf.close()


def test_loads_nobody_will_take_are_cancelled_and_later_layers_keep_theirs():
    """The bugs: a layer's queued loads of experts its router did not choose stayed queued (the
    loader read them ahead of useful work), and loads already issued for a later layer were
    cancelled when a layer started."""
    loads = GatedLoads(blocked=(1, 0))
    pf = Prefetcher(loads, use_thread=True)
    pf.issue(1, [0, 1, 2], skip=lambda k: False)
    pf.issue(2, [3], skip=lambda k: False)  # two layers ahead
    assert loads.started.wait(10)
    pf.begin_layer(1, [0])  # the router chose only expert 0
    loads.release()
    assert pf.take((1, 0)) == "block(1, 0)"
    pf.begin_layer(2, [3])
    assert pf.take((2, 3)) == "block(2, 3)"
    assert (1, 1) not in loads.calls and (1, 2) not in loads.calls
    assert pf.counters.cancelled == 2 and pf.counters.wasted == 0
    pf.close()


def test_a_nearer_prediction_cancels_the_queued_loads_it_dropped():
    """The bug: layer 3 predicted from layer 0 queued (3, 4); predicted again from layer 2 (more
    precise) without 4, the stale load stayed queued and was read anyway: disk bytes for nothing."""
    loads = GatedLoads(blocked=(1, 0))
    pf = Prefetcher(loads, use_thread=True)
    pf.issue(1, [0], skip=lambda k: False)  # runs and blocks the loader
    assert loads.started.wait(10)
    pf.issue(3, [3, 4], skip=lambda k: False)  # three layers ahead: queued
    pf.issue(3, [3, 5], skip=lambda k: False)  # one layer ahead: 4 dropped, 5 added
    loads.release()
    pf.begin_layer(1, [0])
    assert pf.take((1, 0)) == "block(1, 0)"
    pf.begin_layer(3, [3, 5])
    assert pf.take((3, 3)) == "block(3, 3)" and pf.take((3, 5)) == "block(3, 5)"
    assert (3, 4) not in loads.calls
    assert pf.counters.cancelled == 1 and pf.counters.wasted == 0
    pf.close()


def test_a_dropped_load_already_running_skips_its_read_if_not_begun():
    """With two loaders a dropped load is often running (not cancellable) but still waiting for
    the link; it must not read the block once its prediction is gone."""
    link_free, waiting, reads = threading.Event(), threading.Event(), []
    pf: Prefetcher

    def load(key: ExpertKey) -> Any:
        waiting.set()
        assert link_free.wait(10)
        if not pf.wanted(key):
            return SKIPPED
        reads.append(key)
        return f"block{key}"

    pf = Prefetcher(load, use_thread=True, loaders=2)
    pf.issue(2, [5], skip=lambda k: False)
    assert waiting.wait(10)  # (2, 5) is running: waiting for the "link"
    pf.issue(2, [6], skip=lambda k: False)  # the nearer prediction drops 5
    link_free.set()
    pf.begin_layer(2, [6])
    assert pf.take((2, 6)) == "block(2, 6)"
    pf.close()
    assert reads == [(2, 6)]
    assert pf.counters.cancelled == 1 and pf.counters.wasted == 0


def test_queued_loads_run_nearest_layer_first():
    """The bug: loads ran in issue order, so layer 2's experts, predicted at layer 1 (needed
    next), waited behind layers 3 and 4's, issued a step earlier: layer 2's `take` could wait
    for reads of deeper layers, though the module promises it waits only for its own layer's."""
    loads = GatedLoads(blocked=(1, 0))
    order: list[ExpertKey] = []

    def load(key: ExpertKey) -> str:
        order.append(key)
        return loads(key)

    pf = Prefetcher(load, use_thread=True, loaders=1)
    pf.issue(1, [0], skip=lambda k: False)  # runs and blocks the loader
    assert loads.started.wait(10)
    pf.issue(3, [1], skip=lambda k: False)  # issued at layer 0: layers 3 and 4
    pf.issue(4, [2], skip=lambda k: False)
    pf.issue(2, [3, 4], skip=lambda k: False)  # issued at layer 1: layer 2, needed first
    loads.release()
    pf.begin_layer(1, [0])
    pf.begin_layer(2, [3, 4])
    assert pf.take((2, 3)) == "block(2, 3)" and pf.take((2, 4)) == "block(2, 4)"
    pf.close()
    assert order[:3] == [(1, 0), (2, 3), (2, 4)]


def test_closing_the_loaders_cancels_what_is_still_queued():
    loads = GatedLoads(blocked=(1, 0))
    pf = Prefetcher(loads, use_thread=True, loaders=1)
    pf.issue(1, [0, 1], skip=lambda k: False)
    assert loads.started.wait(10)
    queued = pf._pending[(1, 1)]
    threading.Timer(0.05, loads.release).start()
    pf.close()  # waits for the running load, cancels the queued one
    assert queued.cancelled() and loads.calls == {(1, 0): 1}


def test_a_failed_prefetch_is_left_to_the_demand_load():
    def load(key: ExpertKey) -> Any:
        raise OSError("disk on fire")

    pf = Prefetcher(load, use_thread=False)
    pf.issue(3, [1], skip=lambda k: False)
    pf.begin_layer(3, [1])
    assert pf.take((3, 1)) is None  # the caller reads it itself and reports what goes wrong
    assert pf.take((3, 2)) is None  # never prefetched
    pf.close()


# ---- prediction accuracy on non-uniform routing -------------------------------------------------
def _plant_router_bias(eng: Engine, hot: tuple[int, ...], scale: float) -> None:
    """Non-uniform routing: scale the router rows of the `hot` experts in every MoE layer."""
    for layer in eng.spec.moe_layers():
        w = eng.model.layers[layer].mlp.router.weight  # type: ignore[union-attr]
        with torch.no_grad():
            w.data = w.data.clone()
            w.data[list(hot)] *= scale


@pytest.mark.parametrize(
    "routing, norm",
    [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", False), ("sigmoid_group_topk", True)],
)
def test_a_routers_choice_is_the_experts_its_forward_routes_to(routing, norm):
    """Pre-gating asks `Router.choose` for the ids alone (no weights): the same experts, in the
    same order, as the router's forward, for every routing kind."""
    from freetoken_agents.engine.model.moe import Router
    from freetoken_agents.engine.spec import MoESpec

    spec = MoESpec(
        num_experts=16, top_k=4, intermediate_size=8, routing=routing, norm_topk_prob=norm,
        n_group=4, topk_group=2,
    )  # fmt: skip
    router = Router(spec, 12).to_empty(device="cpu")
    g = torch.Generator().manual_seed(1)
    torch.nn.init.normal_(router.weight, generator=g)
    if routing == "sigmoid_group_topk":
        torch.nn.init.normal_(router.e_score_correction_bias, generator=g)
    for tokens in (1, 5):
        h = torch.randn(tokens, 12, generator=g)
        assert torch.equal(router.choose(h), router(h)[0])


def test_one_tokens_pregate_is_its_routed_experts_in_expert_order():
    """Decode takes the ids in one read (one sync on a GPU); prefill ranks by votes."""
    from freetoken_agents.engine.memory.prefetch import pregate
    from freetoken_agents.engine.model.moe import Router
    from freetoken_agents.engine.spec import MoESpec

    spec = MoESpec(num_experts=16, top_k=4, intermediate_size=8, routing="softmax_topk")
    router = Router(spec, 12).to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    torch.nn.init.normal_(router.weight, generator=g)
    for _ in range(20):
        h = torch.randn(1, 12, generator=g)
        ids = router(h)[0][0].tolist()
        assert pregate(router, h, 4) == sorted(ids) and pregate(router, h, 2) == sorted(ids)[:2]
    h = torch.randn(3, 12, generator=g)
    votes = Counter(router(h)[0].reshape(-1).tolist())
    want = sorted(votes, key=lambda e: (-votes[e], e))  # most voted first, ties by expert id
    assert pregate(router, h, 8) == want[:8] and all(isinstance(e, int) for e in want)


def _fp32_ftw(tiny_checkpoint, tmp_path) -> tuple[Path, int]:
    """The tiny Mixtral as an fp32 FTW file, and its experts' tier-1 bytes."""
    ftw = tmp_path / "mixtral.ftw"
    convert_checkpoint(tiny_checkpoint("mixtral"), ftw, quant="fp32", progress=False)
    tiering = TieringOptions(prefetch_thread=False)
    with Engine.from_pretrained(ftw, memory=MemoryBudget(), placement="qstar", tiering=tiering) as probe:
        return ftw, sum(probe.experts.fast_bytes.values())


def test_pregating_beats_frequency_baseline_on_non_uniform_routing(tiny_checkpoint, tmp_path):
    ftw, expert_bytes = _fp32_ftw(tiny_checkpoint, tmp_path)
    tiering = TieringOptions(prefetch_thread=False)
    # Tier 1 holds 60% of the experts and tier 2 ~20%: the rest are read from disk, so there is
    # something to prefetch (pre-gating is skipped while every expert is in tier 1, and on a
    # CPU-only machine while every expert is in RAM).
    budget = MemoryBudget(fast_bytes=int(0.6 * expert_bytes), host_bytes=int(0.2 * expert_bytes))
    eng = Engine.from_pretrained(ftw, memory=budget, placement="qstar", tiering=tiering)
    tp = eng.experts
    _plant_router_bias(eng, hot=(0, 1), scale=2.0)
    routed: Counter[tuple[int, int]] = Counter()
    for i in eng.spec.moe_layers():
        eng.model.layers[i].mlp.router.register_forward_hook(  # type: ignore[union-attr]
            lambda _m, _a, out, i=i: routed.update((i, int(e)) for e in out[0].reshape(-1).tolist())
        )
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):
        prompt = torch.randint(0, eng.spec.vocab_size, (12,), generator=gen).tolist()
        eng.generate(prompt, max_new_tokens=24, stop_token_ids=())
    p = tp.stats()["prefetch"]
    tp.close()
    for layer in eng.spec.moe_layers():  # the routing really is skewed
        counts = [routed[(layer, e)] for e in range(8)]
        assert max(counts) >= 2 * max(1, min(counts)), counts
    print(
        f"\nnext-layer prediction on planted-bias routing: precision {p['precision']:.3f} "
        f"(frequency-only {p['baseline_precision']:.3f}), recall {p['recall']:.3f} "
        f"(frequency-only {p['baseline_recall']:.3f}) over {p['used']} routed experts"
    )
    assert p["used"] > 200
    assert p["recall"] > p["baseline_recall"] + 0.1
    assert p["precision"] > p["baseline_precision"] + 0.1


def test_no_pregating_once_tier_1_holds_every_expert(tiny_checkpoint, tmp_path):
    """With a budget that holds every expert, once they are all in tier 1 there is nothing to
    prefetch nor to keep from eviction: decode steps run no router predictions (they cost ~1 ms a
    token on bench/tiered_decode.py's CPU model), and the tokens stay the resident engine's."""
    folder = tiny_checkpoint("mixtral")
    ftw = tmp_path / "mixtral.ftw"
    convert_checkpoint(folder, ftw, quant="fp32", progress=False)
    tiering = TieringOptions(prefetch_thread=False)
    prompt = list(range(3, 40))
    with Engine.from_pretrained(ftw, memory=MemoryBudget(), placement="qstar", tiering=tiering) as eng:
        tp = eng.experts
        for e in tp.stored_bytes:  # warm: every expert into tier 1
            tp.get(*e)
        assert len(tp.fast) == len(tp.stored_bytes)
        before = tp.stats()["phase_calls"].get("predict", 0)
        tiered = eng.generate(prompt, max_new_tokens=12, stop_token_ids=()).token_ids
        assert tp.stats()["phase_calls"].get("predict", 0) == before
    with Engine.from_pretrained(folder) as resident:
        assert tiered == resident.generate(prompt, max_new_tokens=12, stop_token_ids=()).token_ids


def test_no_pregating_on_a_cpu_while_every_expert_is_in_ram(tiny_checkpoint, tmp_path):
    """CPU-only: prefetch reads tier 3 into tier 2 and nothing else, and a tier-1 miss computes
    from the tier-2 bytes where they are, so with every expert in RAM (tier 1 or tier 2) there is
    nothing to prefetch: no router predictions (~1 ms a token on bench/tiered_decode.py's model);
    once tier 2 cannot hold them all, pre-gating runs again. Tokens stay the resident engine's."""
    folder = tiny_checkpoint("mixtral")
    ftw = tmp_path / "mixtral.ftw"
    convert_checkpoint(folder, ftw, quant="fp32", progress=False)
    tiering = TieringOptions(prefetch_thread=False)
    prompt = list(range(3, 40))
    with Engine.from_pretrained(folder) as resident:
        want = resident.generate(prompt, max_new_tokens=12, stop_token_ids=()).token_ids
    with Engine.from_pretrained(ftw, memory=MemoryBudget(), placement="qstar", tiering=tiering) as probe:
        expert_bytes = sum(probe.experts.fast_bytes.values())
    for host_share, pregates in ((2.0, False), (0.2, True)):
        budget = MemoryBudget(fast_bytes=int(0.4 * expert_bytes), host_bytes=int(host_share * expert_bytes))
        with Engine.from_pretrained(ftw, memory=budget, placement="qstar", tiering=tiering) as eng:
            tp = eng.experts
            for key in tp.stored_bytes:  # every expert read once: tier 1 full, the rest in tier 2
                tp.get(*key)
            before = tp.stats()["phase_calls"].get("predict", 0)
            assert eng.generate(prompt, max_new_tokens=12, stop_token_ids=()).token_ids == want
            assert (tp.stats()["phase_calls"].get("predict", 0) > before) is pregates, host_share


class _ScanCountingDict(dict):
    """A dict that counts the scans of all its values (`values`, `items`, iteration)."""

    scans = 0

    def values(self):  # type: ignore[override]
        type(self).scans += 1
        return super().values()

    def items(self):  # type: ignore[override]
        type(self).scans += 1
        return super().items()

    def __iter__(self):
        type(self).scans += 1
        return super().__iter__()


def test_a_pregated_step_does_not_scan_every_expert(tiny_checkpoint, tmp_path):
    """Each layer's prefetch took the largest expert's size as a max over every expert's: ~70 us a
    layer at Qwen3-30B's 6,144 experts, ~3 ms a token. A decode step with pre-gating running
    reads no whole-model table."""
    ftw, expert_bytes = _fp32_ftw(tiny_checkpoint, tmp_path)
    tiering = TieringOptions(prefetch_thread=False)
    budget = MemoryBudget(fast_bytes=int(0.4 * expert_bytes), host_bytes=int(0.2 * expert_bytes))
    with Engine.from_pretrained(ftw, memory=budget, placement="qstar", tiering=tiering) as eng:
        tp = eng.experts
        tp.fast_bytes = _ScanCountingDict(tp.fast_bytes)
        with eng.new_session() as s:
            s.prefill(list(range(3, 20)))
            before = (_ScanCountingDict.scans, tp.stats()["phase_calls"].get("predict", 0))
            for tok in (5, 7, 9):
                s.decode(tok)
        assert tp.stats()["phase_calls"].get("predict", 0) > before[1]  # pre-gating ran
        assert _ScanCountingDict.scans == before[0]


def _routers(n: int, *, bias: bool = False, routing: str = "softmax_topk", seed: int = 0) -> dict:
    from freetoken_agents.engine.model.moe import Router
    from freetoken_agents.engine.spec import MoESpec

    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(1, n + 1):  # MoE layers 1..n (layer 0 dense)
        spec = MoESpec(
            num_experts=16,
            top_k=4,
            intermediate_size=8,
            routing=routing,
            router_bias=bias,
            n_group=4,
            topk_group=2,
        )
        router = Router(spec, 12).to_empty(device="cpu")
        torch.nn.init.normal_(router.weight, generator=g)
        if bias:
            torch.nn.init.normal_(router.bias, generator=g)
        if routing == "sigmoid_group_topk":
            torch.nn.init.normal_(router.e_score_correction_bias, generator=g)
        out[layer] = router
    return out


@pytest.mark.parametrize("bias", [False, True])
def test_ahead_routers_pick_what_each_coming_layers_router_picks(bias):
    """One router pass for the next `depth` layers: the same experts, in `pregate`'s order, as
    running each coming layer's router alone; the routers' own outputs are unchanged (their
    weights are views of the one buffer)."""
    from freetoken_agents.engine.memory.pregate import AheadRouters, pregate

    routers = _routers(6, bias=bias)
    before = {lay: r.weight.clone() for lay, r in routers.items()}
    ahead = AheadRouters(routers, sorted(routers), depth=3)
    assert ahead.batched
    g = torch.Generator().manual_seed(1)
    layers = sorted(routers)
    for _ in range(25):
        h = torch.randn(1, 12, generator=g)
        for i, layer in enumerate(layers):
            want = [pregate(routers[nxt], h, 4) for nxt in layers[i + 1 : i + 4]]
            assert ahead.choose(layer, h) == want
    assert ahead.choose(layers[-1], h) == []  # nothing ahead of the last MoE layer
    assert ahead.choose(layers[0], torch.randn(3, 12, generator=g)) is None  # prefill: per-layer vote
    for lay, r in routers.items():
        assert torch.equal(r.weight, before[lay])
        assert r.weight.data_ptr() == ahead.weight[(lay - 1) * 16 :].data_ptr()


def test_ahead_routers_follow_a_router_weight_changed_in_place_or_replaced():
    from freetoken_agents.engine.memory.pregate import AheadRouters, pregate

    routers = _routers(4)
    ahead = AheadRouters(routers, sorted(routers), depth=2)
    h = torch.randn(1, 12, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        routers[2].weight[[0, 1, 2, 3]] += 50.0  # in place: the buffer's rows
    assert ahead.choose(1, h)[0] == pregate(routers[2], h, 4) == [0, 1, 2, 3]
    with torch.no_grad():
        routers[3].weight.data = routers[3].weight.data.clone()  # replaced
        routers[3].weight.data[[12, 13, 14, 15]] += 50.0
    assert ahead.choose(1, h) == [[0, 1, 2, 3], [12, 13, 14, 15]]
    assert routers[3].weight.data_ptr() == ahead.weight[2 * 16 :].data_ptr()  # laid out again


def test_ahead_routers_leave_routers_they_cannot_batch_to_pregate():
    from freetoken_agents.engine.memory.pregate import AheadRouters

    h = torch.randn(1, 12)
    assert AheadRouters(_routers(3, routing="sigmoid_group_topk"), [1, 2, 3], depth=2).choose(1, h) is None
    mixed = _routers(3)
    mixed[2] = _routers(1, routing="sigmoid_group_topk")[1]
    assert not AheadRouters(mixed, [1, 2, 3], depth=2).batched
    assert not AheadRouters(_routers(3), [1, 2, 3], depth=0).batched


def test_a_decode_step_pregates_its_coming_layers_in_one_router_pass(tiny_checkpoint, tmp_path, monkeypatch):
    """Each coming layer's router ran on its own: per MoE layer `prefetch_depth` matmuls, top-ks
    and reads of the ids (each a launch or a device sync on a GPU). Now one of each."""
    from freetoken_agents.engine.memory.pregate import AheadRouters
    from freetoken_agents.engine.model.moe import Router

    ftw, expert_bytes = _fp32_ftw(tiny_checkpoint, tmp_path)
    tiering = TieringOptions(prefetch_thread=False)
    budget = MemoryBudget(fast_bytes=int(0.4 * expert_bytes), host_bytes=int(0.2 * expert_bytes))
    calls: Counter[str] = Counter()
    choose, batched = Router.choose, AheadRouters.choose
    monkeypatch.setattr(Router, "choose", lambda self, x: (calls.update(["router"]), choose(self, x))[1])
    monkeypatch.setattr(
        AheadRouters, "choose", lambda self, layer, x: (calls.update(["ahead"]), batched(self, layer, x))[1]
    )
    with Engine.from_pretrained(ftw, memory=budget, placement="qstar", tiering=tiering) as eng:
        tp = eng.experts
        with eng.new_session() as s:
            s.prefill(list(range(3, 20)))
            calls.clear()
            before = tp.stats()["phase_calls"].get("predict", 0)
            for tok in (5, 7, 9):
                s.decode(tok)
        assert tp.stats()["phase_calls"].get("predict", 0) > before  # pre-gating ran
    assert calls["ahead"] > 0 and calls["router"] == 0
