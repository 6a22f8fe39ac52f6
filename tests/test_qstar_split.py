"""SPLIT: one missed expert spread over the CPU and the link (CUDA). The CPU computes it but for the
last rows of its down projection, which the link copies meanwhile and the device computes; q*
sizes the device's share so that both finish together."""

from __future__ import annotations

import pytest
import torch

from freetoken_agents.engine.codecs import get_codec
from freetoken_agents.engine.experts import ExpertWeights
from freetoken_agents.engine.memory import (
    BandwidthOracle,
    ComputeCostModel,
    ExpertCase,
    FastTier,
    HostTier,
    ManualClock,
    Placement,
    QStarPolicy,
)
from freetoken_agents.engine.memory.planner import ExpertPlanner
from freetoken_agents.engine.memory.policy import DOWN_SHARE
from freetoken_agents.engine.memory.routing import RoutingFrequency
from freetoken_agents.engine.routed import expert_forward, expert_forward_split, split_rows
from freetoken_agents.engine.simulate.profiles import load_profile
from freetoken_agents.engine.simulate.replay import TieredReplay, group_steps
from freetoken_agents.engine.simulate.shapes import shape_for
from freetoken_agents.engine.simulate.synthetic import MIXTRAL_8X7B, preset_trace
from freetoken_agents.engine.spec import MoESpec

MB = 10**6
COPY_S = 4e-3  # 100 MB of tier-1 form over a 25 GB/s link
HOST_S = 1.4e-3  # computing it on the CPU
FAST_S = 0.1e-3  # computing it on the GPU
SPEC = MoESpec(num_experts=4, top_k=2, intermediate_size=64, routing="softmax_topk")


def _weights(form: str, hidden: int = 96, inter: int = 64, bias: bool = False) -> ExpertWeights:
    g = torch.Generator().manual_seed(0)
    t = {
        "gate_up": torch.randn(2 * inter, hidden, generator=g),
        "down": torch.randn(hidden, inter, generator=g),
        "gate_up_bias": torch.randn(2 * inter, generator=g) if bias else None,
        "down_bias": torch.randn(hidden, generator=g) if bias else None,
    }
    if form == "int8":
        return ExpertWeights.quantized(t, torch.float32)
    if form == "mxfp4":
        out = {k: v for k, v in t.items() if v is not None}
        for name in ("gate_up", "down"):
            enc = get_codec("mxfp4").encode(t[name])
            n, k = t[name].shape
            out[name], out[f"{name}_scale"] = enc.parts["blocks"].reshape(n, k // 2), enc.parts["scales"]
        return ExpertWeights(**out)
    return ExpertWeights(**{k: v for k, v in t.items() if v is not None})


@pytest.mark.parametrize("form", ["fp32", "int8", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_a_split_expert_computes_what_the_whole_expert_computes(form: str, tokens: int) -> None:
    w = _weights(form, bias=form != "int8")
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(1))
    want = expert_forward(w, x, SPEC)
    for rows in (8, 32, 88):  # each output row is the same dot product, on one side or the other
        got = expert_forward_split(w, x, SPEC, torch.device("cpu"), rows)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_split_rows_leave_work_on_both_sides() -> None:
    assert split_rows(4096, 0.3) == 1232
    assert split_rows(4096, 0.001) == 8 and split_rows(4096, 1.0) == 4088
    assert split_rows(10, 0.9) == 5


def _policy() -> QStarPolicy:
    compute = ComputeCostModel()
    compute.set("cuda", "decoded", 1, FAST_S)
    compute.set("cpu-host", "mxfp4", 1, HOST_S)
    return QStarPolicy(
        BandwidthOracle("storage->host", prior_bps=5e9),
        BandwidthOracle("host->fast", prior_bps=100 * MB / COPY_S),
        BandwidthOracle("activations", prior_bps=25e9),
        compute,
        fast_device="cuda",
        host_device="cpu-host",
    )


def _case(**kw) -> ExpertCase:
    base = dict(
        tokens=1,
        codec="mxfp4",
        resident=False,
        in_host=True,
        stored_bytes=100 * MB,
        fast_bytes=100 * MB,
        activation_bytes=16_384,
        can_split=True,
    )
    base.update(kw)
    return ExpertCase(**base)


def test_q_star_splits_a_miss_so_that_the_cpu_and_the_link_finish_together() -> None:
    p = _policy()
    case = _case()
    share = p.split_share(case)
    # The CPU's part and the link's part of the rows take the same time.
    cpu = (1 - DOWN_SHARE * share) * HOST_S
    link = DOWN_SHARE * share * COPY_S
    assert share > 0.5 and cpu == pytest.approx(link)
    costs = p.costs(case)
    assert costs[Placement.SPLIT] < costs[Placement.HOST]
    assert p.decide((0, 1), case) is Placement.SPLIT
    # A busy CPU moves more rows to the link (all of them, at most); a busy link fewer, then none.
    assert p.split_share(_case(host_wait_s=1e-3)) == 1.0
    assert p.split_share(_case(link_wait_s=0.8e-3)) < share
    assert p.split_share(_case(link_wait_s=2e-3)) == 0.0
    assert p.decide((0, 2), _case(link_wait_s=2e-3)) is Placement.HOST
    # No option where the planner says so (a CPU-only machine, a staged copy).
    assert Placement.SPLIT not in p.costs(_case(can_split=False))


def test_the_planner_books_a_split_on_the_cpu_and_the_link() -> None:
    clock = ManualClock()
    keys = [(0, e) for e in range(4)]
    fast: FastTier = FastTier(2 * 100 * MB)
    host: HostTier = HostTier(None)
    for k in keys:
        host.put(k, True, 100 * MB)
    for k in keys[:2]:
        fast.put(k, True, 100 * MB)
    planner = ExpertPlanner(
        fast=fast,
        host=host,
        policy=_policy(),
        routing=RoutingFrequency([0]),
        layers=[0],
        stored_bytes=dict.fromkeys(keys, 100 * MB),
        fast_bytes=dict.fromkeys(keys, 100 * MB),
        codecs=dict.fromkeys(keys, "mxfp4"),
        link_bytes=lambda _k: 100 * MB,
        device="cuda",
        clock=clock,
    )
    planner.note_routing(0, [2, 3])
    assert planner.decide((0, 2), 1, staged=False) is Placement.SPLIT
    share = planner.take_split((0, 2))
    assert planner.host_free_at == pytest.approx((1 - DOWN_SHARE * share) * HOST_S)
    assert planner.link_free_at == pytest.approx(DOWN_SHARE * share * COPY_S)
    # The next miss sees both busy: still split, the same balance from where each is.
    second = planner.case((0, 3), 1, staged=False)
    assert second.host_wait_s > 0 and second.link_wait_s > 0
    with pytest.raises(KeyError):
        planner.take_split((0, 2))  # taken once


def test_the_replay_splits_misses_and_is_faster_for_it() -> None:
    """Mixtral-8x7B MXFP4 on an RTX 4090 at half the expert bytes: a PCIe 4 copy of an expert takes
    ~2.8x the CPU's compute of it, so q* computed every miss it did not stage on the CPU and the
    link idled; split, each miss gives the link a share of its rows."""
    shape = shape_for("mixtral-8x7b")
    profile = load_profile("rtx4090-pcie4")
    steps = group_steps(preset_trace(MIXTRAL_8X7B, tokens=96, seed=0))
    budget = shape.total_expert_bytes("mxfp4") // 2

    class NoSplit(QStarPolicy):
        def split_share(self, case: ExpertCase) -> float:
            return 0.0

    def run(policy_cls: type[QStarPolicy]) -> tuple[float, dict[str, int], float]:
        replay = TieredReplay(shape, profile, codec="mxfp4", fast_bytes=budget, host_bytes=None)
        p = replay.policy
        replay.policy = replay.planner.policy = policy_cls(
            p.storage, p.host_fast, p.activations, p.compute, fast_device="cuda", host_device="cpu-host"
        )
        tally = replay.run(steps)
        return tally.tokens / tally.seconds, dict(tally.decisions), tally.bytes["host->fast"] / tally.tokens

    split_tps, split_decisions, split_bytes = run(QStarPolicy)
    plain_tps, plain_decisions, plain_bytes = run(NoSplit)
    assert split_decisions.get("split", 0) > 2 * len(steps) and "split" not in plain_decisions
    assert split_tps > 1.04 * plain_tps
    assert split_bytes > plain_bytes  # the rows crossed the link


@pytest.mark.parametrize("quant", ["fp32", "int8"])
def test_the_providers_split_computes_the_expert_from_its_tier2_bytes(
    tiny_checkpoint, tmp_path, quant
) -> None:
    """The live SPLIT (`_split_compute`, a GPU's path) run on this CPU, where "the device" is the
    CPU too: the expert from its tier-2 bytes equals the same expert computed whole, the rows
    count as moved, and the CPU's time is observed for q*."""
    from freetoken_agents.engine.loading.convert import convert_checkpoint
    from freetoken_agents.engine.memory import MemoryBudget, TieredExpertProvider

    ftw = tmp_path / f"mixtral-{quant}.ftw"
    convert_checkpoint(tiny_checkpoint("mixtral"), ftw, quant=quant, progress=False)
    tp = TieredExpertProvider(ftw, MemoryBudget(), top_k=2, prefetch=False)
    key = tp.keys()[3]
    w = tp.moves.decode(key, tp.moves.host_value(key))
    hidden, inter = w.down.shape
    spec = MoESpec(num_experts=8, top_k=2, intermediate_size=inter, routing="softmax_topk")
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(2))
    before = tp.moves.stats()["host->fast"]
    got = tp._split_compute(key, x, spec, 0.5)
    torch.testing.assert_close(got, expert_forward(w, x, spec), rtol=1e-5, atol=1e-5)
    assert tp.moves.stats()["host->fast"] > before
    assert tp.policy.compute.measured("cpu-host", tp.codec[key], 2) is not None
    tp.close()
