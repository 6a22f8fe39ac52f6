"""One entry point computes a routed batch (engine/model/routed.py): the resident, FTW-lazy and tiered
stores all call `routed.run_routed`, and give the same bits for the same experts, whichever path
it chooses (grouped GEMM, top-2 pair, per-expert loop)."""

from __future__ import annotations

import pytest
import torch

from freetoken_agents.engine.ftw import FTWFile
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.loading.ftw_provider import FTWExpertProvider
from freetoken_agents.engine.memory import MemoryBudget, TieredExpertProvider
from freetoken_agents.engine.model import routed
from freetoken_agents.engine.model.experts import InMemoryExpertProvider
from freetoken_agents.engine.spec import MoESpec

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_store_computes_a_routed_batch_through_run_routed_with_the_same_bits(
    tiny_checkpoint, tmp_path, monkeypatch
):
    ftw = tmp_path / "mixtral.ftw"
    convert_checkpoint(tiny_checkpoint("mixtral"), ftw, quant="fp32", progress=False)
    calls: list[tuple[int, bool, str]] = []  # (tokens, a stack given, get or compute)
    inner = routed.run_routed

    def spy(hidden, expert_ids, weights, spec, **kw):
        calls.append((hidden.shape[0], kw.get("stack") is not None, "get" if "get" in kw else "compute"))
        return inner(hidden, expert_ids, weights, spec, **kw)

    monkeypatch.setattr(routed, "run_routed", spy)
    paths: list[str] = []  # what run_routed chose
    for name in ("run_grouped", "run_pair", "dispatch_experts"):
        kernel = getattr(routed, name)
        monkeypatch.setattr(routed, name, lambda *a, _k=kernel, _n=name: paths.append(_n) or _k(*a))
    with FTWFile(ftw) as f:
        lazy = FTWExpertProvider(f)
        resident = InMemoryExpertProvider(FTWExpertProvider(f).take_all())
        tiered = TieredExpertProvider(ftw, MemoryBudget(), top_k=2, prefetch=False)
        try:
            layer, _ = lazy.keys()[0]
            experts = sorted(e for lay, e in lazy.keys() if lay == layer)
            hidden_size = resident.get(layer, 0).gate_up.shape[1]
            spec = MoESpec(
                num_experts=len(experts),
                top_k=2,
                intermediate_size=resident.get(layer, 0).down.shape[1],
                routing="softmax_topk",
            )
            stack = resident.stack(layer)
            assert stack is not None  # so its pair and grouped paths are exercised
            g = torch.Generator().manual_seed(0)
            decode_ids = torch.randperm(len(experts), generator=g)[:2][None]
            prefill_ids = torch.stack([torch.randperm(len(experts), generator=g)[:2] for _ in range(6)])
            # Decode (top-2 pair in the resident store; the tiered store brings both experts into
            # tier 1), the same experts again (the tiered store's all-resident step), prefill
            # (grouped GEMM in the resident store).
            grouped = "run_grouped" if routed.use_grouped(stack, 6) else "dispatch_experts"
            cases = (
                (decode_ids, "run_pair", "compute"),
                (decode_ids, "run_pair", "get"),
                (prefill_ids, grouped, "compute"),
            )
            for ids, resident_path, tiered_way in cases:
                tokens = ids.shape[0]
                hidden = torch.randn(tokens, hidden_size, generator=g)
                weights = torch.softmax(torch.randn(tokens, 2, generator=g), dim=-1)
                calls.clear()
                paths.clear()
                outs = [store.run(layer, hidden, ids, weights, spec) for store in (resident, lazy, tiered)]
                assert calls == [(tokens, True, "get"), (tokens, False, "get"), (tokens, False, tiered_way)]
                assert paths == [resident_path, "dispatch_experts", "dispatch_experts"]
                for out in outs[1:]:
                    assert torch.equal(out, outs[0])
        finally:
            tiered.close()
