"""The replay takes the live tiered memory's decisions: on the same routing and the same measured
costs, `TieredReplay` (virtual bytes, virtual clock) and `TieredExpertProvider` (a real FTW file,
real reads and decodes) place every expert alike, step by step; `simulate` refuses what it cannot
replay in one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from freetoken_agents.engine import Engine
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.memory import (
    BandwidthOracle,
    ComputeCostModel,
    MemoryBudget,
    Placement,
    QStarPolicy,
    TieredExpertProvider,
)
from freetoken_agents.engine.memory.routing_trace import RoutingRecord, RoutingTraceError, group_steps
from freetoken_agents.engine.simulate.baselines import layer_steps
from freetoken_agents.engine.simulate.machine import ExpertCosts
from freetoken_agents.engine.simulate.profiles import load_profile
from freetoken_agents.engine.simulate.replay import SimulationError, TieredReplay
from freetoken_agents.engine.simulate.shapes import shape_for, shape_from_spec
from freetoken_agents.engine.simulate.simulator import POLICIES, bound, simulate
from freetoken_agents.engine.simulate.stats import belady_missing, filled_at_load
from freetoken_agents.engine.simulate.synthetic import (
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    preset_trace,
    synthetic_trace,
)

pytestmark = pytest.mark.usefixtures("one_thread")


class FrozenOracle(BandwidthOracle):
    """A link whose estimate never moves: the live run's timings do not change its prices."""

    def record(self, nbytes: int, seconds: float) -> None:
        pass


class FrozenCompute(ComputeCostModel):
    def observe(self, device: str, codec: str, tokens: int, seconds: float, times: int = 1) -> None:
        pass


class RecordingPolicy(QStarPolicy):
    """q* that logs each decision it takes, in order."""

    def __init__(self) -> None:
        compute = FrozenCompute()
        compute.set("cpu", "decoded", 1, 50e-6)
        compute.set("cpu-host", "fp32", 1, 200e-6)
        super().__init__(
            FrozenOracle("storage->host", prior_bps=1e9),
            FrozenOracle("host->fast", prior_bps=1e8),
            None,
            compute,
            fast_device="cpu",
            host_device="cpu-host",
        )
        self.log: list[tuple[tuple[int, int], str]] = []

    def decide(self, key, case):
        place = super().decide(key, case)
        self.log.append((key, place.value))
        return place


@pytest.fixture(scope="module")
def tiny_ftw(tiny_checkpoint, tmp_path_factory) -> Path:
    ftw = tmp_path_factory.mktemp("replay") / "mixtral.ftw"
    convert_checkpoint(tiny_checkpoint("mixtral"), ftw, quant="fp32", progress=False)
    return ftw


@pytest.mark.parametrize("start", ["empty", "filled-at-load", "warm-start"])
def test_the_replay_takes_the_live_runs_decisions_on_the_same_routing(tiny_ftw: Path, start: str) -> None:
    warm = start == "warm-start"
    resident = Engine.from_pretrained(tiny_ftw)
    spec = resident.spec
    moe_layers = spec.moe_layers()
    moe = spec.layers[moe_layers[0]].moe
    shape = shape_from_spec(spec)

    def trace(seed: int) -> list[RoutingRecord]:
        return [
            dataclasses.replace(r, layer=moe_layers[r.layer])
            for r in synthetic_trace(
                layers=len(moe_layers),
                num_experts=moe.num_experts,
                top_k=moe.top_k,
                tokens=48,
                reuse=0.4,
                skew=0.8,
                cross_layer=0.0,
                seed=seed,
            )
        ]

    records = trace(3)
    profile = group_steps(trace(4)[: 12 * len(moe_layers)]) if warm else []  # another run's first 12 tokens
    live_policy = RecordingPolicy()
    probe = TieredExpertProvider(tiny_ftw, MemoryBudget(), top_k=moe.top_k, prefetch=False)
    key = probe.keys()[0]
    stored, fast = probe.stored_bytes[key], probe.fast_bytes[key]
    probe.close()
    budget = 5 * fast  # 5 of the model's experts: contested, so q* has choices to make
    live = TieredExpertProvider(
        tiny_ftw,
        MemoryBudget(fast_bytes=budget),
        top_k=moe.top_k,
        prefetch=False,
        policy=live_policy,
        hot_every=4,
    )
    if warm:
        assert live.warm_start(profile) == 5  # tier 1 full before the first token
    elif start == "filled-at-load":
        assert live.fill_fast() == 5
    gen = torch.Generator().manual_seed(0)
    for r in records:
        hidden = torch.randn(1, spec.hidden_size, generator=gen)
        ids = torch.tensor([list(r.experts)])
        weights = torch.tensor([list(r.weights)])
        live.run(r.layer, hidden, ids, weights, spec.layers[r.layer].moe)
    live.close()

    replay_policy = RecordingPolicy()
    costs = dataclasses.replace(
        ExpertCosts.of(shape, load_profile("cpu-ddr5"), "fp32"), stored_bytes=stored, fast_bytes=fast
    )
    replay = TieredReplay(
        shape,
        load_profile("cpu-ddr5"),
        codec="fp32",
        fast_bytes=budget,
        host_bytes=None,
        prefetch_depth=0,
        hot_every=4,
        policy=replay_policy,
        costs=costs,
        warm_host=False,
        warm_start=profile,
        fill_at_load=start == "filled-at-load",
    )
    assert len(replay.fast) == (0 if start == "empty" else 5)
    if start == "filled-at-load":  # the same experts, in the same order
        assert replay.fast.keys() == [(lay, e) for e in range(2) for lay in moe_layers][:5]
    replay.run(group_steps(records))

    placements = {p for _, p in live_policy.log}
    assert {Placement.STREAM.value, Placement.HOST.value} <= placements  # a test with choices in it
    assert replay_policy.log == live_policy.log
    assert replay_policy.decisions == live_policy.decisions  # the residents counted alike too
    assert replay.fast.keys() == live.fast.keys()
    assert replay.host.keys() == live.host.keys()


def test_simulate_reports_every_policy_and_a_bound_above_them() -> None:
    shape = shape_for("mixtral-8x7b")
    records = preset_trace(MIXTRAL_8X7B, tokens=24, seed=1)
    budget = shape.total_expert_bytes("mxfp4") // 2
    report = simulate(records, shape, load_profile("rtx4090-pcie4"), fast_bytes=budget, codec="mxfp4")
    assert [r.policy for r in report.results] == list(POLICIES)
    assert report.decode_tokens == 24 and report.simulated
    for r in report.results:
        assert 0 < r.tokens_per_s <= report.bound.tokens_per_s
        assert 0 <= r.misses_per_token["fast"] <= shape.top_k * len(shape.moe_layers)
    assert report.result("stream").misses_per_token["fast"] == shape.top_k * len(shape.moe_layers)
    assert report.result("belady").misses_per_token["fast"] == report.bound.misses_per_token["fast"]
    # The online bound caches with LRU: no fewer misses than Belady's, so no faster.
    online = report.online_bound
    assert online.misses_per_token["fast"] > report.bound.misses_per_token["fast"]
    assert 0 < online.tokens_per_s < report.bound.tokens_per_s
    assert report.result("static").cpu_experts_per_token == report.result("static").misses_per_token["fast"]
    assert report.result("layer-lru").cpu_experts_per_token == 0
    # The engine's policies with their own misses perfectly overlapped: no slower than they ran.
    for r in report.results:
        if r.policy in ("qstar", "qstar-profiled", "layer-lru"):
            assert r.tokens_per_s <= r.overlapped_tokens_per_s * (1 + 1e-9)
        else:
            assert r.overlapped_tokens_per_s is None


def test_a_policys_own_misses_are_served_as_the_bound_serves_beladys() -> None:
    """`bound(fast_missing=...)` serves given misses as the bound serves Belady's: given Belady's
    own, it is the bound; given a replay's, the tok/s its misses allow with perfect overlap."""
    shape = shape_for("qwen3-30b-a3b")
    records = preset_trace(QWEN3_30B_A3B, tokens=6, seed=0)
    steps = group_steps(records)
    layers = list(shape.moe_layers)
    profile = load_profile("rtx4090-pcie4")
    costs = ExpertCosts.of(shape, profile, "mxfp4")
    fast_bytes = shape.total_expert_bytes("mxfp4") // 2
    plain = bound(steps, layers, costs, fast_bytes=fast_bytes, host_bytes=None)
    cap = fast_bytes // costs.fast_bytes
    belady = filled_at_load(belady_missing(layer_steps(steps, layers), cap), cap)
    given = bound(steps, layers, costs, fast_bytes=fast_bytes, host_bytes=None, fast_missing=belady)
    assert given == plain
    replay = TieredReplay(shape, profile, codec="mxfp4", fast_bytes=fast_bytes, host_bytes=None)
    missed: list[list[int]] = []  # per (step, MoE layer), through the replay's hook
    tally = replay.run(steps, on_layer=lambda _step, _layer, keys: missed.append(keys))
    assert len(missed) == len(steps) * len(layers)
    assert sum(map(len, missed)) == tally.fast_misses  # decode steps only in this trace
    own = bound(steps, layers, costs, fast_bytes=fast_bytes, host_bytes=None, fast_missing=missed)
    assert own.misses_per_token["fast"] * tally.tokens == pytest.approx(tally.fast_misses)
    assert tally.tokens / tally.seconds <= own.tokens_per_s <= plain.tokens_per_s
    one_short = r"^fast_missing has 287 entries; the steps have 288 \(6 steps x 48 MoE layers\)$"
    with pytest.raises(SimulationError, match=one_short):
        bound(steps, layers, costs, fast_bytes=fast_bytes, host_bytes=None, fast_missing=missed[1:])


def test_belady_and_the_bounds_start_with_tier_1_filled_as_every_policy_does() -> None:
    """q* and the static split start with tier 1 filled at load, untimed. Belady streaming and both
    bounds started it empty and paid a copy for every expert it then held: with room for every
    expert they still missed each once (on the Qwen3-30B-A3B / RTX 4090 / 50% replay, 300
    tokens, ~10 copies a token: Belady ran at 137 tok/s where 158 is its speed filled)."""
    shape = shape_for("mixtral-8x7b")
    records = preset_trace(MIXTRAL_8X7B, tokens=6, seed=0)
    report = simulate(
        records,
        shape,
        load_profile("h200"),  # every expert and the dense weights fit its memory (not a 4090's)
        fast_bytes=shape.total_expert_bytes("mxfp4"),
        codec="mxfp4",
        policies=("static", "belady"),
    )
    belady, static = report.result("belady"), report.result("static")
    assert belady.misses_per_token["fast"] == static.misses_per_token["fast"] == 0
    assert belady.bytes_per_token.get("host->fast", 0) == 0
    assert belady.tokens_per_s == pytest.approx(static.tokens_per_s)  # both every expert resident
    for b in (report.bound, report.online_bound):
        assert b.misses_per_token["fast"] == 0
        assert b.tokens_per_s == pytest.approx(static.tokens_per_s)


def test_no_policy_beats_the_bound_with_little_ram() -> None:
    """With tier 2 smaller than a layer's experts the bound read every routed expert from the
    disk (tier 2's Belady misses over every use), while the policies' disks read only what
    neither tier held: Belady streaming ran at 3.8x "the bound"."""
    shape = shape_for("mixtral-8x7b")
    records = preset_trace(MIXTRAL_8X7B, tokens=16, seed=0)
    total = shape.total_expert_bytes("mxfp4")
    report = simulate(
        records,
        shape,
        load_profile("rtx4090-pcie4"),
        fast_bytes=total // 2,
        host_bytes=total // 100,
        codec="mxfp4",
    )
    assert report.bound.limited_by == "disk"
    for r in report.results:
        assert 0 < r.tokens_per_s <= report.bound.tokens_per_s, r.policy
    # Belady over both tiers together misses no more than Belady over tier 1 alone.
    assert report.bound.misses_per_token["host"] <= report.bound.misses_per_token["fast"]


def test_the_bound_runs_the_layers_one_after_another() -> None:
    """A miss computed on the CPU needs its layer's hidden state, so the CPU cannot take a layer's
    misses while other layers run. The bound summed the CPU's misses over the whole trace beside
    the device's work: with a link too slow to help it read each token as max(every layer's dense
    part, every miss on the CPU), not their sum, 1.5x what any policy could reach here."""
    shape = shape_for("mixtral-8x7b")
    records = preset_trace(MIXTRAL_8X7B, tokens=16, seed=0)
    slow_link = dataclasses.replace(load_profile("rtx4090-pcie4"), link_gbps=0.5)
    fast_bytes = shape.total_expert_bytes("mxfp4") // 4
    report = simulate(
        records, shape, slow_link, fast_bytes=fast_bytes, codec="mxfp4", policies=("static", "belady")
    )
    costs = ExpertCosts.of(shape, slow_link, "mxfp4")
    misses = report.bound.misses_per_token["fast"] * report.decode_tokens
    # The layers one after another, every miss on the CPU (the link takes a handful at most).
    dense = report.decode_tokens * len(shape.moe_layers) * costs.dense_s(1)
    serial = dense + misses * costs.host_compute_s(1)
    assert report.bound.limited_by == "layers"
    assert report.bound.tokens_per_s <= report.decode_tokens / serial * (1 + 1e-9)
    # The static split computes every miss on the CPU too: within reach of the bound, not above.
    static = report.result("static").tokens_per_s
    assert 0.5 * report.bound.tokens_per_s < static <= report.bound.tokens_per_s


def test_a_trace_of_another_model_is_refused_in_one_line() -> None:
    records = preset_trace(MIXTRAL_8X7B, tokens=2, seed=0)
    with pytest.raises(RoutingTraceError, match=r"^routing trace does not fit qwen3-30b-a3b: [^\n]*$"):
        simulate(records, shape_for("qwen3-30b-a3b"), load_profile("rtx4090-pcie4"), fast_bytes=10**12)


def test_a_budget_below_one_layers_experts_and_an_unknown_policy_are_refused() -> None:
    shape = shape_for("mixtral-8x7b")
    records = preset_trace(MIXTRAL_8X7B, tokens=2, seed=0)
    with pytest.raises(SimulationError, match="cannot hold one layer's top-2 experts"):
        simulate(records, shape, load_profile("rtx4090-pcie4"), fast_bytes=1000)
    with pytest.raises(SimulationError, match="unknown policies"):
        simulate(records, shape, load_profile("rtx4090-pcie4"), fast_bytes=10**12, policies=["lru"])


def test_prefill_records_of_a_sequence_are_one_step() -> None:
    records = [RoutingRecord(0, t, 0, (t % 2, 2), (0.5, 0.5), "prefill") for t in range(3)] + [
        RoutingRecord(0, 3, 0, (1, 2), (0.5, 0.5), "decode")
    ]
    steps = group_steps(records)
    assert [(s.phase, s.tokens) for s in steps] == [("prefill", 3), ("decode", 1)]
    assert steps[0].layers == {0: {0: 2, 2: 3, 1: 1}}


def test_the_predictor_misses_the_same_experts_of_a_layer_from_every_nearer_layer() -> None:
    """A layer is predicted again from each nearer layer, and pre-gating from successive layers
    reads nearly the same hidden state. Drawn anew at each prediction, recall 0.5 over three
    predictions kept ~7/8 of a layer's experts, with the wrong fillers of every draw staged too."""
    shape = shape_for("mixtral-8x7b")
    budget = shape.total_expert_bytes("mxfp4") // 2
    profile = load_profile("rtx4090-pcie4")
    replay = TieredReplay(shape, profile, codec="mxfp4", fast_bytes=budget, host_bytes=None, recall=0.5)
    kept: dict[tuple[int, int], set[frozenset[int]]] = {}
    step = 0
    run_step, predict = replay._run_step, replay._predict

    def counted_step(s):
        nonlocal step
        step += 1
        return run_step(s)

    def spied(layer, truth, tokens):
        pred = predict(layer, truth, tokens)
        kept.setdefault((step, layer), set()).add(frozenset(e for e in pred if e in truth))
        return pred

    replay._run_step, replay._predict = counted_step, spied
    replay.run(group_steps(preset_trace(MIXTRAL_8X7B, tokens=40, seed=3)))
    assert sum(len(sets) == 1 for sets in kept.values()) == len(kept) > 1000  # one draw per step
    # Routed experts predicted: those drawn (recall 0.5), and some as fillers (the most used).
    share = sum(len(next(iter(sets))) for sets in kept.values()) / (len(kept) * shape.top_k)
    assert 0.5 < share < 0.75


def test_the_replays_staging_room_shrinks_to_what_the_link_fills_and_tier1_gets_the_rest() -> None:
    shape = shape_for("mixtral-8x7b")
    budget = shape.total_expert_bytes("mxfp4") // 2
    replay = TieredReplay(
        shape, load_profile("rtx4090-pcie4"), codec="mxfp4", fast_bytes=budget, host_bytes=None
    )
    expert = replay.costs.fast_bytes
    assert replay.planner.room == 6 and replay.fast.capacity_bytes == budget - 6 * expert
    replay.run(group_steps(preset_trace(MIXTRAL_8X7B, tokens=40, seed=0)))
    # ~1.1-1.6 ms layers, 3.75 ms copies, 3 layers ahead: the copy landed meanwhile and a layer's two
    # wait at once (the room follows the layer time, refitted every 16 tokens); tier 1 holds the rest.
    room = replay.planner.room
    assert room is not None and 3 <= room < 6
    assert replay.fast.capacity_bytes == budget - room * expert
