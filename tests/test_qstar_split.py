"""SPLIT: one missed expert spread over the CPU and the link (CUDA). The CPU computes it but for the
last rows of its down projection, which the link copies meanwhile and the device computes; q*
sizes the device's share so that both finish together."""

from __future__ import annotations

import pytest
import torch

from freetoken_agents.engine.ftw.codecs import get_codec
from freetoken_agents.engine.memory import (
    ExpertCase,
    QStarPolicy,
)
from freetoken_agents.engine.memory.routing_trace import group_steps
from freetoken_agents.engine.model.experts import ExpertWeights
from freetoken_agents.engine.model.routed import expert_forward, expert_forward_split, split_rows
from freetoken_agents.engine.simulate.profiles import load_profile
from freetoken_agents.engine.simulate.replay import TieredReplay
from freetoken_agents.engine.simulate.shapes import shape_for
from freetoken_agents.engine.simulate.synthetic import MIXTRAL_8X7B, preset_trace
from freetoken_agents.engine.spec import MoESpec

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
