"""Tiered expert memory: LRU/pinning, the shared host LRU, exact logits under tight budgets,
budget errors, KV pressure shrinking and regrowing the expert tier, prefetch counters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken_agents.engine import Engine
from freetoken_agents.engine.errors import FTWFormatError, MemoryBudgetError
from freetoken_agents.engine.ftw import FTWWriter, encode
from freetoken_agents.engine.memory import FastTier, HostTier, MemoryBudget, TieredExpertProvider


def write_ftw(engine: Engine, path: Path, codec: str = "fp32") -> Path:
    """Write `engine`'s in-RAM experts as FTW expert blocks (until `freetoken convert` lands)."""
    experts = engine.experts
    with FTWWriter(path, model_config={"model_type": engine.spec.model_type}) as w:
        for layer, e in experts.keys():  # type: ignore[attr-defined]
            tensors = experts.get(layer, e).tensors()
            w.add_expert(layer, e, {k: encode(v, codec) for k, v in tensors.items()})
    return path


def expert_bytes(engine: Engine) -> int:
    return engine.experts.nbytes  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def built(tiny_checkpoint, tmp_path_factory):
    cache: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in cache:
            folder = tiny_checkpoint(arch)
            ftw = write_ftw(Engine.from_pretrained(folder), tmp_path_factory.mktemp("ftw") / f"{arch}.ftw")
            cache[arch] = (folder, ftw)
        return cache[arch]

    return get


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- tiers -------------------------------------------------------------------------------------
def test_lru_evicts_least_recently_used_first():
    t = FastTier[str](300, max_pinned_fraction=1.0)
    for i in range(3):
        t.put((0, i), f"e{i}", 100)
    assert t.get((0, 0)) == "e0"  # (0, 1) is now the coldest
    assert t.put((0, 3), "e3", 100) == [(0, 1)]
    assert t.put((0, 4), "e4", 100) == [(0, 2)]
    assert t.keys() == [(0, 0), (0, 3), (0, 4)]
    assert t.counters.evictions == 2 and t.counters.hits == 1


def test_pinned_experts_are_never_evicted_by_put_and_go_last_on_resize():
    t = FastTier[str](300, max_pinned_fraction=1.0)
    for i in range(3):
        t.put((0, i), f"e{i}", 100)
    assert t.pin((0, 0)) and t.pin((0, 1))
    for i in range(3, 10):
        evicted = t.put((1, i), "x", 100)
        assert (0, 0) not in evicted and (0, 1) not in evicted
    assert (0, 0) in t and (0, 1) in t
    assert not t.fits(200)  # only 100 bytes are not pinned
    assert t.resize(100) == [(1, 9), (0, 0)]  # unpinned first, then pinned coldest-first
    assert t.keys() == [(0, 1)]


def test_pin_cap_limits_hot_set():
    t = FastTier[str](400, max_pinned_fraction=0.5)
    for i in range(4):
        t.put((0, i), "x", 100)
    assert t.set_hot([(0, 3), (0, 2), (0, 1)]) == [(0, 2), (0, 3)]


def test_host_tier_is_one_lru_across_layers():
    t = HostTier[bytes](400)
    t.put((0, 0), b"a", 100)
    t.put((1, 0), b"b", 100)
    t.put((2, 0), b"c", 100)
    t.put((0, 1), b"d", 100)
    t.get((0, 0))
    # A hot layer may push out another layer's experts: eviction order is global recency.
    assert t.put((5, 5), b"e", 200) == [(1, 0), (2, 0)]
    assert t.keys() == [(0, 1), (0, 0), (5, 5)]


# ---- provider correctness ----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5])
def test_logits_equal_in_ram_engine_under_tight_budget(arch, fraction, built):
    folder, ftw = built(arch)
    ref = Engine.from_pretrained(folder)
    eng = Engine.from_pretrained(folder)
    kv = 4 * eng.kv_pool.bytes_per_block  # 36 tokens need 3 blocks of 16
    probe = TieredExpertProvider(ftw, MemoryBudget(), top_k=1)
    ws = TieredExpertProvider(ftw, MemoryBudget(), top_k={
        i: eng.spec.layers[i].moe.top_k for i in eng.spec.moe_layers()  # type: ignore[union-attr]
    }).min_working_set
    fast = kv + max(ws, int(fraction * expert_bytes(ref)))
    host = max(probe.stored_bytes.values()) * 2
    tp = TieredExpertProvider.for_engine(
        eng, ftw, MemoryBudget(fast_bytes=fast, host_bytes=host), prefetch_thread=False
    )
    ids = _prompt(eng.spec.vocab_size, 20)
    with ref.new_session() as a, eng.new_session() as b:
        la, lb = a.prefill(ids), b.prefill(ids)
        assert torch.equal(la, lb)
        tok = int(la[-1].argmax())
        for _ in range(16):
            x, y = a.decode(tok), b.decode(tok)
            assert torch.equal(x, y)
            tok = int(x.argmax())
    s = tp.stats()
    assert s["tiers"]["fast"]["used_bytes"] <= s["tiers"]["fast"]["capacity_bytes"]
    assert s["tiers"]["host"]["used_bytes"] <= host
    if fraction < 0.5:
        assert s["tiers"]["fast"]["evictions"] + s["policy"]["decisions"].get("host", 0) > 0
    tp.close()


def test_budget_below_one_layers_active_experts_raises_at_construction(built):
    _, ftw = built("mixtral")
    probe = TieredExpertProvider(ftw, MemoryBudget(), top_k=2)
    with pytest.raises(MemoryBudgetError, match="minimum expert working set"):
        TieredExpertProvider(ftw, MemoryBudget(fast_bytes=probe.min_working_set - 1), top_k=2)
    TieredExpertProvider(ftw, MemoryBudget(fast_bytes=probe.min_working_set), top_k=2)


def test_kv_growth_shrinks_expert_tier_and_freeing_regrows_it(built):
    folder, ftw = built("mixtral")
    ref, eng = Engine.from_pretrained(folder), Engine.from_pretrained(folder)
    bpb = eng.kv_pool.bytes_per_block
    ws = TieredExpertProvider(ftw, MemoryBudget(), top_k=2).min_working_set
    fast = ws + 12 * bpb  # 12 KV blocks of room; the long prompt needs 11
    tp = TieredExpertProvider.for_engine(eng, ftw, MemoryBudget(fast_bytes=fast), prefetch_thread=False)
    cap0 = tp.fast.capacity_bytes
    short, long = _prompt(eng.spec.vocab_size, 16, 1), _prompt(eng.spec.vocab_size, 160, 2)
    with eng.new_session() as s:
        s.prefill(short)
    for prompt in (short, long):  # 10x the context under the same budget
        assert ref.generate(prompt, max_new_tokens=4, stop_token_ids=()).token_ids == eng.generate(
            prompt, max_new_tokens=4, stop_token_ids=()
        ).token_ids
    st = tp.stats()["tiers"]["fast"]
    assert st["shrinks"] > 0 and st["regrows"] > 0
    assert tp.kv_bytes == 0 and tp.fast.capacity_bytes == cap0
    with eng.new_session() as s, pytest.raises(MemoryBudgetError, match=r"KV cache \(\d+ bytes\)"):
        s.prefill(_prompt(eng.spec.vocab_size, 16 * 15, 3))
    assert eng.generate(short, max_new_tokens=2, stop_token_ids=()).token_ids  # still usable


def test_prefetch_counters_move(built):
    folder, ftw = built("mixtral")
    eng = Engine.from_pretrained(folder)
    tp = TieredExpertProvider.for_engine(eng, ftw, MemoryBudget(), prefetch_thread=False)
    eng.generate(_prompt(eng.spec.vocab_size, 8, 4), max_new_tokens=8, stop_token_ids=())
    p = tp.stats()["prefetch"]
    assert p["predicted"] > 0 and p["used"] > 0 and p["issued"] > 0
    assert 0 < p["precision"] <= 1 and 0 < p["recall"] <= 1
    assert p["taken"] > 0


def test_threaded_prefetch_gives_identical_logits(built):
    folder, ftw = built("mixtral")
    ref, eng = Engine.from_pretrained(folder), Engine.from_pretrained(folder)
    ws = TieredExpertProvider(ftw, MemoryBudget(), top_k=2).min_working_set
    budget = MemoryBudget(fast_bytes=3 * ws + 8 * eng.kv_pool.bytes_per_block)
    tp = TieredExpertProvider.for_engine(eng, ftw, budget)
    ids = _prompt(eng.spec.vocab_size, 12, 5)
    assert ref.generate(ids, max_new_tokens=16, stop_token_ids=()).token_ids == eng.generate(
        ids, max_new_tokens=16, stop_token_ids=()
    ).token_ids
    tp.close()


def test_corrupted_block_raises_ftw_format_error_and_session_stays_usable(built, tmp_path):
    folder, ftw = built("mixtral")
    bad = tmp_path / "bad.ftw"
    bad.write_bytes(ftw.read_bytes())
    eng = Engine.from_pretrained(folder)
    tp = TieredExpertProvider.for_engine(eng, bad, MemoryBudget(), prefetch=False)
    info = tp.ftw.expert_info(*tp.ftw.expert_keys()[-1])
    with open(bad, "r+b") as f:
        f.seek(info.data_offset + 7)
        f.write(b"\xff\x00\xff")
    tp.host.capacity_bytes = 0  # keep nothing in tier 2 so every use reads the file
    tp.fast.resize(tp.min_working_set)
    with eng.new_session() as s, pytest.raises(FTWFormatError, match="checksum"):
        for t in _prompt(eng.spec.vocab_size, 64, 6):
            s.decode(t)
