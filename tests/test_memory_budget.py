"""MemoryBudget.from_fractions, Engine.stats(), BlockPool.shrink and the per-layer-LRU baseline."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from freetoken_agents.engine import Engine
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.memory import LayerLRUTier, MemoryBudget, TieredExpertProvider
from freetoken_agents.engine.memory.budget import free_host_bytes
from freetoken_agents.engine.model.kv import BlockPool, BlockTable, StreamSpec
from freetoken_agents.engine.options import TieringOptions

GB = 10**9


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine: a second OpenMP thread only adds stalls."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# ---- budgets from fractions -------------------------------------------------------------------
def test_from_fractions_on_cpu_uses_free_ram():
    b = MemoryBudget.from_fractions(fast=0.5, host=0.3, free_host=lambda: 10 * GB)
    assert (b.fast_bytes, b.host_bytes, b.kv_bytes) == (5 * GB, 3 * GB, None)
    assert MemoryBudget.from_fractions(host=0.25, free_host=lambda: 8 * GB).fast_bytes is None


def test_from_fractions_on_cuda_reads_device_free_memory_for_fast():
    b = MemoryBudget.from_fractions(
        fast=0.9, host=0.5, device="cuda:0", free_host=lambda: 100 * GB, free_device=lambda d: 20 * GB
    )
    assert (b.fast_bytes, b.host_bytes) == (18 * GB, 50 * GB)  # fractions of two different pools


@pytest.mark.parametrize("kw", [{"fast": 0.0}, {"fast": 1.5}, {"host": -0.1}, {"fast": 0.7, "host": 0.4}])
def test_from_fractions_rejects_bad_fractions(kw):
    with pytest.raises(ValueError, match="from_fractions"):
        MemoryBudget.from_fractions(**kw, free_host=lambda: GB)


def test_free_host_bytes_is_real():
    assert free_host_bytes() > 0
    assert 0 < MemoryBudget.from_fractions(fast=0.01).fast_bytes < free_host_bytes()  # type: ignore[operator]


# ---- BlockPool.shrink -------------------------------------------------------------------------
def _pool() -> BlockPool:
    return BlockPool([[StreamSpec("k", (2, 4))]], block_size=4, initial_blocks=16)


def test_shrink_releases_trailing_free_blocks_when_kv_is_freed():
    pool = _pool()
    keep, big = BlockTable(pool), BlockTable(pool)
    slots = keep.reserve(8)  # blocks 0, 1
    keep.write(0, "k", slots, torch.arange(64.0).view(8, 2, 4))
    big.reserve(4 * 60)  # grows the pool to 64 blocks
    assert pool.capacity == 64
    big.release()  # everything past block 1 is free and at the end: released
    assert pool.capacity == 16 and pool.storage[0]["k"].shape[0] == 16
    assert torch.equal(keep.read(0, "k"), torch.arange(64.0).view(8, 2, 4))  # live data intact
    more = keep.reserve(4)
    assert more.max() < 16 * 4 and pool.blocks_in_use == 3


def test_shrink_keeps_storage_when_free_blocks_are_not_at_the_end():
    pool = _pool()
    low, high = BlockTable(pool), BlockTable(pool)
    low.reserve(4 * 30)
    high.reserve(4 * 30)  # the last blocks belong to `high`
    cap = pool.capacity
    low.release()
    assert pool.capacity == cap  # freeing the middle never renumbers live blocks
    assert pool.shrink() == 0
    high.release()
    assert pool.capacity == 16


def test_shrink_has_hysteresis():
    pool = _pool()
    t = BlockTable(pool)
    t.reserve(4 * 20)  # 20 blocks of 32
    assert pool.capacity == 32
    t.truncate(4 * 18)  # 14 trailing free blocks < half the capacity: keep
    assert pool.capacity == 32
    t.truncate(4)
    assert pool.capacity == 16


# ---- Engine.stats -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixtral(tiny_checkpoint, tmp_path_factory):
    folder = tiny_checkpoint("mixtral")
    ftw = tmp_path_factory.mktemp("ftw") / "mixtral.ftw"
    convert_checkpoint(folder, ftw, quant="fp32", progress=False)
    return folder, ftw


def test_engine_stats_basic_and_tiered(mixtral):
    folder, ftw = mixtral
    eng = Engine.from_pretrained(folder)
    s = eng.stats()
    assert s["experts_in_ram"] == len(eng.experts.keys()) and s["expert_bytes_in_ram"] > 0  # type: ignore[attr-defined]
    with eng.new_session() as sess:
        sess.prefill([1, 2, 3, 4, 5])
        assert eng.stats()["kv_blocks_in_use"] == 1
        assert eng.stats()["kv_bytes_in_use"] == eng.kv_pool.bytes_per_block
    ws = TieredExpertProvider(ftw, MemoryBudget(), top_k=2).min_working_set
    budget = MemoryBudget(fast_bytes=ws + 4 * eng.kv_pool.bytes_per_block, host_bytes=ws)
    eng = Engine.from_pretrained(
        ftw, memory=budget, placement="qstar", tiering=TieringOptions(prefetch_thread=False)
    )
    tp = eng.experts
    eng.generate([1, 2, 3, 4, 5, 6], max_new_tokens=8, stop_token_ids=())
    st = eng.stats()
    for tier in ("fast", "host"):  # hits and misses per tier
        assert st["tiers"][tier]["hits"] + st["tiers"][tier]["misses"] > 0
    assert st["tiers"]["storage"]["reads"] > 0 and st["tiers"]["storage"]["direct_io"]
    assert st["bytes_moved"]["storage->host"] > 0 and st["bytes_moved"]["host->fast"] > 0
    assert 0 < st["prefetch"]["precision"] <= 1 and 0 < st["prefetch"]["recall"] <= 1
    history = st["bandwidth"]["storage->host"]["history"]  # bandwidth estimates over time
    assert len(history) >= 2 and history[-1][0] >= history[0][0] and history[-1][1] > 0
    assert sum(st["policy"]["decisions"].values()) > 0
    for phase in ("attention", "experts", "wait_storage", "predict"):
        assert st["phase_s"][phase] > 0, phase
    assert st["kv_blocks_in_use"] == 0
    tp.close()
    lazy = Engine.from_pretrained(ftw)  # FTWExpertProvider: experts decoded so far
    assert lazy.stats()["experts_in_ram"] == 0


# ---- per-layer LRU baseline -------------------------------------------------------------------
def test_layer_lru_tier_evicts_within_the_layer_only():
    t = LayerLRUTier[str](400, n_layers=2)  # 200 bytes per layer
    t.put((0, 0), "a", 100)
    t.put((0, 1), "b", 100)
    t.put((1, 0), "c", 100)
    assert t.victims_for(100, (1, 1)) == [] and t.victims_for(100, (0, 2)) == [(0, 0)]
    assert t.put((0, 2), "d", 100) == [(0, 0)]
    assert t.set_hot([(0, 1)]) == [] and not t.fits(300, (0, 5))


def test_stream_placement_baseline_is_exact_and_never_hosts(mixtral):
    folder, ftw = mixtral
    ref = Engine.from_pretrained(ftw)  # all resident, same weights
    probe = TieredExpertProvider(ftw, MemoryBudget(), top_k=2, placement="stream")
    fast = probe.min_working_set + 8 * ref.kv_pool.bytes_per_block
    eng = Engine.from_pretrained(
        ftw, memory=MemoryBudget(fast_bytes=fast), placement="stream", tiering=TieringOptions(prefetch=False)
    )
    tp = eng.experts
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    want = ref.generate(ids, max_new_tokens=8, stop_token_ids=()).token_ids
    assert eng.generate(ids, max_new_tokens=8, stop_token_ids=()).token_ids == want
    d = tp.stats()["policy"]["decisions"]
    assert d.get("host", 0) == 0 and d["stream"] > 0
    with pytest.raises(ValueError, match="placement"):
        TieredExpertProvider(ftw, MemoryBudget(), top_k=2, placement="lfu")
