"""q*'s hot path: a decode step whose routed experts are all in tier 1 makes no per-expert
decision (RESIDENT is the only placement q* prices for them); decisions are made for misses only,
and the logits stay those of the all-in-RAM engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from freetoken_agents.engine import Engine
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.memory import FastTier, MemoryBudget
from freetoken_agents.engine.memory.moves import shares_memory
from freetoken_agents.engine.options import TieringOptions


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def mixtral(tiny_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny Mixtral and its fp32 FTW file. References load the FTW too: MKL's GEMV rounds
    differently for a weight at an unaligned address (an mmap view of a safetensors file can
    be one), so only the same file gives bit-identical logits."""
    folder = tiny_checkpoint("mixtral")
    ftw = tmp_path_factory.mktemp("ftw") / "mixtral.ftw"
    convert_checkpoint(folder, ftw, quant="fp32", progress=False)
    return folder, ftw


def test_get_all_is_all_or_nothing():
    t = FastTier[str](None)
    for i in range(3):
        t.put((0, i), f"e{i}", 10)
    assert t.get_all([(0, 0), (0, 5)]) is None
    assert t.counters.hits == 0 and t.keys() == [(0, 0), (0, 1), (0, 2)]  # nothing touched
    assert t.get_all([(0, 1), (0, 0)]) == ["e1", "e0"]
    assert t.counters.hits == 2 and t.keys() == [(0, 2), (0, 1), (0, 0)]  # both most recent now


def _decisions(engine: Engine) -> list[tuple[int, int]]:
    """Spy on the real policy: the keys it is asked to decide for."""
    asked: list[tuple[int, int]] = []
    policy = engine.experts.policy  # type: ignore[attr-defined]
    decide = policy.decide
    policy.decide = lambda key, case: asked.append(key) or decide(key, case)
    return asked


def test_all_resident_decode_makes_no_decision(mixtral):
    _, ftw = mixtral
    ref = Engine.from_pretrained(ftw)  # all resident, same (aligned) weights
    eng = Engine.from_pretrained(  # tier 1 filled by demand, not at load: the warm-up decides
        ftw,
        memory=MemoryBudget(),
        placement="qstar",
        tiering=TieringOptions(prefetch=False, fill_at_load=False),
    )
    ids = [5, 3, 8, 1, 9, 2, 7, 4]
    with ref.new_session() as a, eng.new_session() as b:
        a.prefill(ids)
        b.prefill(ids)
        asked = _decisions(eng)
        for t in range(24):  # warm-up: every expert comes into the unbounded tier 1 once
            assert torch.equal(a.decode(t), b.decode(t))
        misses = len(asked)
        assert 0 < misses <= eng.spec.num_layers * 8  # each (layer, expert) decided at most once
        before = dict(eng.experts.policy.decisions_by_phase)  # type: ignore[attr-defined]
        for t in range(24, 40):
            assert torch.equal(a.decode(t), b.decode(t))
    assert len(asked) == misses  # every routed expert was resident: no decision at all
    after = eng.experts.policy.decisions_by_phase  # type: ignore[attr-defined]
    routed = 16 * len(eng.spec.moe_layers()) * 2  # tokens x MoE layers x top-2
    assert after["decode/resident"] - before.get("decode/resident", 0) == routed
    eng.experts.close()  # type: ignore[attr-defined]


def test_with_every_expert_in_tier_1_decode_prices_nothing(mixtral):
    """Nothing can miss while tier 1 holds every expert, so a decode step leaves q*'s compute
    model alone (no per-expert observation on the hot path); the experts are still timed."""
    _, ftw = mixtral
    eng = Engine.from_pretrained(  # tier 1 filled by demand, not at load: the warm-up decides
        ftw,
        memory=MemoryBudget(),
        placement="qstar",
        tiering=TieringOptions(prefetch=False, fill_at_load=False),
    )
    tp = eng.experts
    with eng.new_session() as s:
        s.prefill([5, 3, 8, 1])
        s.decode(2)  # observed: tier 1 does not hold every expert yet
        assert tp.policy.compute.snapshot()  # type: ignore[attr-defined]
        for key in tp.keys():  # type: ignore[attr-defined]
            tp.get(*key)  # type: ignore[attr-defined]
        before = tp.policy.compute.snapshot()  # type: ignore[attr-defined]
        calls = tp.stats()["phase_calls"]["experts"]  # type: ignore[attr-defined]
        for t in range(8):
            s.decode(t)
    assert tp.policy.compute.snapshot() == before  # type: ignore[attr-defined]
    assert tp.stats()["phase_calls"]["experts"] == calls + 8 * len(eng.spec.moe_layers())  # type: ignore[attr-defined]
    tp.close()  # type: ignore[attr-defined]


def test_decisions_are_made_for_misses_only(mixtral):
    _, ftw = mixtral
    ref = Engine.from_pretrained(ftw)
    probe = Engine.from_pretrained(ftw, memory=MemoryBudget(), placement="qstar")
    working_set = probe.experts.min_working_set  # type: ignore[attr-defined]
    probe.experts.close()  # type: ignore[attr-defined]
    budget = MemoryBudget(fast_bytes=2 * working_set + 8 * ref.kv_pool.bytes_per_block)
    eng = Engine.from_pretrained(
        ftw, memory=budget, placement="qstar", tiering=TieringOptions(prefetch=False)
    )
    tp = eng.experts
    asked = _decisions(eng)
    misses_before = tp.fast.counters.misses  # type: ignore[attr-defined]
    with ref.new_session() as a, eng.new_session() as b:
        a.prefill([1, 2, 3])
        b.prefill([1, 2, 3])
        for t in range(20):
            assert torch.equal(a.decode(t), b.decode(t))
    misses = tp.fast.counters.misses - misses_before  # type: ignore[attr-defined]
    assert tp.fast.counters.evictions > 0  # type: ignore[attr-defined]  # the budget was tight
    assert len(asked) == misses > 0  # one decision per tier-1 miss, none for hits
    tp.close()  # type: ignore[attr-defined]


def test_a_tier_2_block_is_parsed_once_while_it_stays_in_tier_2(mixtral, monkeypatch):
    """A HOST computation reads the expert's tier-2 block as zero-copy views; the views are kept
    with the block, so computing it again does not parse and validate the block again. When the
    block leaves tier 2 the views go too (its read buffer may then be reused), and a block read
    again is parsed again."""
    _, ftw = mixtral
    engine = Engine.from_pretrained(
        ftw,
        memory=MemoryBudget(fast_bytes=1 << 20),
        placement="qstar",
        tiering=TieringOptions(prefetch=False, fill_at_load=False),  # (1, 3) not in tier 1
    )
    moves = engine.experts.moves
    parsed: list[tuple[int, int]] = []
    real = moves.ftw.encoded_stored

    def counting(layer, expert, stored, **kw):
        parsed.append((layer, expert))
        return real(layer, expert, stored, **kw)

    monkeypatch.setattr(moves.ftw, "encoded_stored", counting)
    key = (1, 3)
    value = moves.host_value(key)
    first = moves.decode(key, value)
    again = moves.decode(key, value)
    assert again is first and parsed == [key]
    assert shares_memory(first, value)  # views of the block's bytes, no copy
    moves.host.resize(0)  # tier 2 drops every block (as an eviction would)
    assert key not in moves.host and key not in moves._host_weights
    moves.host.resize(None)
    value = moves.host_value(key)
    assert moves.decode(key, value) is not first and parsed == [key, key]
    # Promoted, its bytes move up into tier 1 (zero-copy); evicted, they come back to tier 2
    # with their views: the next use parses nothing.
    lifted = moves.promote(key, None)
    assert key in moves.backing and key not in moves.host
    with moves.lock:
        moves.fast.resize(0)
    assert key in moves.host and moves.decode(key, moves.host.peek(key)) is lifted
    assert parsed == [key, key]
    engine.experts.close()
