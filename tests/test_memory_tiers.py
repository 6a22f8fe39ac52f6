"""Tiered expert memory: LRU/pinning, the shared host LRU, exclusive RAM tiers, exact logits under
tight budgets, budget errors, one session's KV growth shrinking and regrowing the expert tier, a
corrupted block found mid-generation."""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from freetoken_agents.engine import Engine
from freetoken_agents.engine.errors import FTWFormatError, MemoryBudgetError
from freetoken_agents.engine.ftw import FTWFile
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.memory import BlockReader, FastTier, HostTier, MemoryBudget, TieredExpertProvider
from freetoken_agents.engine.memory.routing import RoutingFrequency
from freetoken_agents.engine.model.experts import DelegatingStore, ExpertKey, run_experts
from freetoken_agents.engine.options import TieringOptions


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine: a second OpenMP thread only adds stalls (8x here)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def tiered(ftw: Path, budget: MemoryBudget, *, placement: str = "qstar", **tiering) -> Engine:
    """An engine over `ftw` with tiered experts, built by the composition root."""
    return Engine.from_pretrained(ftw, memory=budget, placement=placement, tiering=TieringOptions(**tiering))


def expert_bytes(engine: Engine) -> int:
    return engine.experts.nbytes  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def built(tiny_checkpoint, tmp_path_factory):
    cache: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in cache:
            folder = tiny_checkpoint(arch)
            ftw = tmp_path_factory.mktemp("ftw") / f"{arch}.ftw"
            convert_checkpoint(folder, ftw, quant="fp32", progress=False)
            cache[arch] = (folder, ftw)
        return cache[arch]

    return get


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _top_k(eng: Engine) -> dict[int, int]:
    return {i: eng.spec.layers[i].moe.top_k for i in eng.spec.moe_layers()}  # type: ignore[union-attr]


def _check_exclusive(tp: TieredExpertProvider) -> None:
    """Every expert whose tier-1 weights are views of its stored bytes is not also in tier 2."""
    for key in tp.moves.backing:
        assert key in tp.fast and key not in tp.host


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


def test_host_tier_is_one_lru_across_layers_and_reports_evictions():
    t = HostTier[bytes](400)
    dropped: list[tuple[ExpertKey, bytes]] = []
    t.on_evict = lambda k, v: dropped.append((k, v))  # type: ignore[assignment,misc]
    t.put((0, 0), b"a", 100)
    t.put((1, 0), b"b", 100)
    t.put((2, 0), b"c", 100)
    t.put((0, 1), b"d", 100)
    t.get((0, 0))
    # A hot layer may push out another layer's experts: eviction order is global recency.
    assert t.put((5, 5), b"e", 200) == [(1, 0), (2, 0)]
    assert t.keys() == [(0, 1), (0, 0), (5, 5)]
    assert dropped == [((1, 0), b"b"), ((2, 0), b"c")]
    assert t.pop((0, 1)) == b"d" and len(dropped) == 2  # pop hands the value over: no eviction


def test_a_ranked_tier_evicts_the_lowest_rank_first_and_lru_among_equals():
    t = HostTier[str](400)
    score = {(0, 0): 5.0, (0, 1): 1.0, (1, 0): 1.0, (1, 1): 9.0}
    t.rank = lambda k: score.get(k, 0.0)  # type: ignore[assignment,arg-type]
    for k in score:
        t.put(k, "x", 100)
    t.get((0, 1))  # (1, 0) is now the least recent of the two rank-1 keys
    assert t.eviction_order() == [(1, 0), (0, 1), (0, 0), (1, 1)]
    assert t.put((2, 0), "y", 100) == [(1, 0)]  # not (0, 0), the least recently used
    t.protected = lambda k: k == (0, 1)  # type: ignore[assignment]
    assert t.victims_for(200) == [(2, 0), (0, 0)]  # needed soon: skipped while others free room
    assert t.evict_coldest() == (2, 0)


def test_qstar_tier_2_evicts_the_least_used_expert_not_the_least_recent(built):
    """What leaves RAM is chosen by decayed routing frequency under q* (bench/offload.py: 228 ->
    204 MB read per decode token); the per-layer LRU baseline keeps plain recency."""
    _, ftw = built("mixtral")
    probe = TieredExpertProvider(ftw, MemoryBudget(), top_k=2)
    one = probe.fast_bytes[(0, 0)]
    budget = MemoryBudget(fast_bytes=2 * one, host_bytes=2 * one)
    tp = TieredExpertProvider(ftw, budget, top_k=2, prefetch=False)
    tp.routing.by_layer[0].update({0: 3.0, 1: 0.5, 2: 2.0, 3: 2.5})
    for e in range(4):  # (0, 0) and (0, 1) end up in tier 2, (0, 0) the least recently used
        tp.get(0, e)
    assert sorted(tp.host.keys()) == [(0, 0), (0, 1)] and tp.host.keys()[0] == (0, 0)
    tp.get(0, 4)  # one expert must leave RAM: the rarely used (0, 1), not the older (0, 0)
    assert (0, 0) in tp.host and (0, 1) not in tp.host and (0, 1) not in tp.fast
    tp.close()
    baseline = TieredExpertProvider(ftw, MemoryBudget(), top_k=2, prefetch=False, placement="stream")
    assert baseline.host.rank is None
    baseline.close()
    probe.close()


# ---- provider correctness ----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5])
def test_logits_equal_in_ram_engine_under_tight_budget(arch, fraction, built):
    folder, ftw = built(arch)
    ref = Engine.from_pretrained(ftw)  # all resident, same weights
    kv = 4 * ref.kv_pool.bytes_per_block  # 36 tokens need 3 blocks of 16
    probe = TieredExpertProvider(ftw, MemoryBudget(), top_k=_top_k(ref))
    fast = kv + max(probe.min_working_set, int(fraction * expert_bytes(ref)))
    host = max(probe.stored_bytes.values()) * 2
    eng = tiered(ftw, MemoryBudget(fast_bytes=fast, host_bytes=host), prefetch_thread=False)
    tp = eng.experts
    ids = _prompt(eng.spec.vocab_size, 20)
    with ref.new_session() as a, eng.new_session() as b:
        la, lb = a.prefill(ids), b.prefill(ids)
        assert torch.equal(la, lb)
        tok = int(la[-1].argmax())
        for _ in range(16):
            x, y = a.decode(tok), b.decode(tok)
            assert torch.equal(x, y)
            tok = int(x.argmax())
            _check_exclusive(tp)
    s = tp.stats()
    assert s["tiers"]["fast"]["used_bytes"] <= s["tiers"]["fast"]["capacity_bytes"]
    assert s["tiers"]["host"]["used_bytes"] <= host
    assert s["tiers"]["fast"]["evictions"] > 0  # the budget really was too small for all experts
    assert s["tiers"]["storage"]["reads"] > len(probe.stored_bytes)  # some experts were read again
    tp.close()


def test_exclusive_ram_tiers_hold_fast_plus_host_distinct_experts(built):
    """The bug: tier 1 held copies of experts that also stayed in tier 2, so with fast = host = 2
    experts only 2 distinct experts were in RAM and re-using 4 of them re-read 2 from disk."""
    _, ftw = built("mixtral")
    probe = TieredExpertProvider(ftw, MemoryBudget(), top_k=2)
    one = probe.fast_bytes[(0, 0)]
    assert probe.stored_bytes[(0, 0)] <= one  # fp32 block: the stored bytes are the weights
    budget = MemoryBudget(fast_bytes=2 * one, host_bytes=2 * one)
    tp = TieredExpertProvider(ftw, budget, top_k=2, prefetch=False)
    keys = [(0, 0), (0, 1), (0, 2), (0, 3)]
    first = {k: tp.get(*k).gate_up.clone() for k in keys}
    read = tp.stats()["file_bytes_read"]
    assert read >= 4 * probe.stored_bytes[(0, 0)]
    for k in keys:  # every one is still in RAM: no disk read
        assert torch.equal(tp.get(*k).gate_up, first[k])
    assert tp.stats()["file_bytes_read"] == read
    assert sorted(tp.fast.keys()) == keys[2:] and sorted(tp.host.keys()) == keys[:2]  # demoted
    _check_exclusive(tp)
    assert tp.fast.used_bytes + tp.host.used_bytes <= 4 * one
    assert tp.reader.buffers.reused == 0  # nothing left RAM, so no buffer was recycled
    tp.get(0, 4)  # now one expert must leave RAM; its buffer is recycled for the next read
    tp.get(0, 5)
    assert tp.reader.reads == 6 and tp.reader.buffers.reused >= 1
    tp.close()


def test_host_compute_time_excludes_the_disk_read(built):
    """The bug: HOST placements timed the tier-3 read together with the matmul, so the measured
    host compute cost (which q* compares with tier-1 compute) grew with disk latency and q* priced
    the read twice (it already adds the storage link's fetch time)."""
    folder, ftw = built("mixtral")
    bpb = Engine.from_pretrained(folder).kv_pool.bytes_per_block
    ws = TieredExpertProvider(ftw, MemoryBudget(), top_k=2).min_working_set
    budget = MemoryBudget(fast_bytes=ws + 4 * bpb, host_bytes=1)  # keeps nothing
    eng = tiered(ftw, budget, prefetch=False)
    tp = eng.experts
    tp.policy.compute.set("cpu", "decoded", 1, 1.0)  # tier-1 compute looks slow: q* computes on the host
    read = tp.reader.read

    def slow_read(layer: int, expert: int, **kw):
        time.sleep(0.05)  # a slow disk
        return read(layer, expert, **kw)

    tp.reader.read = slow_read  # type: ignore[method-assign]
    eng.generate(_prompt(eng.spec.vocab_size, 4, 9), max_new_tokens=3, stop_token_ids=())
    assert tp.stats()["policy"]["decisions_by_phase"].get("decode/host", 0) > 0
    assert tp.stats()["tiers"]["storage"]["reads"] > 8  # every host use went to the disk
    assert tp.policy.compute.estimate("cpu-host", "fp32", 1) < 0.02  # the matmul, not the read
    tp.close()


@pytest.mark.parametrize("kw", [{"fast_bytes": 0}, {"host_bytes": -1}, {"kv_bytes": 0}])
def test_budget_values_must_be_positive(kw):
    with pytest.raises(ValidationError):
        MemoryBudget(**kw)


def test_budget_below_one_layers_active_experts_raises_at_construction(built):
    _, ftw = built("mixtral")
    probe = TieredExpertProvider(ftw, MemoryBudget(), top_k=2)
    with pytest.raises(MemoryBudgetError, match="minimum expert working set"):
        TieredExpertProvider(ftw, MemoryBudget(fast_bytes=probe.min_working_set - 1), top_k=2)
    TieredExpertProvider(ftw, MemoryBudget(fast_bytes=probe.min_working_set), top_k=2)


def test_one_session_grows_10x_under_a_fixed_fast_budget(built):
    folder, ftw = built("mixtral")
    ref = Engine.from_pretrained(ftw)  # all resident, same weights
    bpb = ref.kv_pool.bytes_per_block
    probe = TieredExpertProvider(ftw, MemoryBudget(), top_k=2)
    fast = probe.min_working_set + 11 * bpb  # 160 tokens need 10 blocks of 16
    budget = MemoryBudget(fast_bytes=fast, host_bytes=4 * probe.stored_bytes[(0, 0)])
    eng = tiered(ftw, budget, prefetch_thread=False)
    tp = eng.experts
    cap0 = tp.fast.capacity_bytes
    caps = []
    with ref.new_session() as a, eng.new_session() as b:
        prompt = _prompt(eng.spec.vocab_size, 16, 1)
        la, lb = a.prefill(prompt, last_only=True)[0], b.prefill(prompt, last_only=True)[0]
        assert torch.equal(la, lb)
        tok = int(la.argmax())
        while b.cached_tokens < 160:  # 10x the first context, greedy, one session
            x, y = a.decode(tok), b.decode(tok)
            assert torch.equal(x, y)
            tok = int(x.argmax())
            caps.append(tp.fast.capacity_bytes)
            _check_exclusive(tp)
        grown = tp.stats()
    assert min(caps) <= cap0 - 9 * bpb  # the expert tier gave its room to the KV cache
    assert grown["tiers"]["fast"]["shrinks"] >= 9 and grown["budget"]["kv_bytes"] >= 10 * bpb
    st = tp.stats()  # the session closed: its KV blocks are free again
    assert st["tiers"]["fast"]["regrows"] > 0 and st["budget"]["kv_bytes"] == 0
    assert tp.fast.capacity_bytes == cap0
    with eng.new_session() as s, pytest.raises(MemoryBudgetError, match=r"KV cache \(\d+ bytes\)"):
        s.prefill(_prompt(eng.spec.vocab_size, 16 * 13, 3))  # more KV than the whole budget
    assert eng.generate(prompt, max_new_tokens=2, stop_token_ids=()).token_ids  # still usable
    tp.close()


def test_threaded_prefetch_gives_identical_logits(built):
    folder, ftw = built("mixtral")
    ref = Engine.from_pretrained(ftw)  # all resident, same weights
    ws = TieredExpertProvider(ftw, MemoryBudget(), top_k=2).min_working_set
    budget = MemoryBudget(fast_bytes=3 * ws + 8 * ref.kv_pool.bytes_per_block, host_bytes=2 * ws)
    eng = tiered(ftw, budget)
    tp = eng.experts
    ids = _prompt(eng.spec.vocab_size, 12, 5)
    assert (
        ref.generate(ids, max_new_tokens=16, stop_token_ids=()).token_ids
        == eng.generate(ids, max_new_tokens=16, stop_token_ids=()).token_ids
    )
    assert tp.stats()["prefetch"]["taken"] > 0
    tp.close()


# ---- a corrupted block found mid-generation -----------------------------------------------------
class Recorder(DelegatingStore):
    """Wraps an engine's provider and records the (layer, expert) keys each step routes to."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine.experts)
        self.steps: list[set] = []
        engine.use_expert_provider(self)

    def get(self, layer: int, expert: int):
        return self.inner.get(layer, expert)

    def run(self, layer, hidden, ids, weights, spec):
        if layer == 0:
            self.steps.append(set())
        self.steps[-1] |= {(layer, int(e)) for e in ids.reshape(-1).tolist()}
        return run_experts(self.get, layer, hidden, ids, weights, spec)


def _first_new_expert(folder: Path) -> tuple[list[int], int, ExpertKey]:
    """A prompt, a decode step and an expert that step is the first to use."""
    ref = Engine.from_pretrained(folder)
    rec = Recorder(ref)
    for seed in range(20):
        prompt = _prompt(ref.spec.vocab_size, 2, seed)
        rec.steps.clear()
        ref.generate(prompt, max_new_tokens=8, stop_token_ids=())
        for s in range(1, len(rec.steps)):
            new = rec.steps[s] - set().union(*rec.steps[:s])
            if new:
                return prompt, s, min(new)
    raise AssertionError("no decode step used a new expert")


def test_corrupted_block_mid_generation_is_named_and_the_session_stays_usable(built, tmp_path):
    folder, ftw = built("mixtral")
    prompt, bad_step, bad = _first_new_expert(folder)
    damaged = tmp_path / "bad.ftw"
    damaged.write_bytes(ftw.read_bytes())
    ref = Engine.from_pretrained(ftw)  # all resident, same weights
    rec = Recorder(ref)
    # Tier 1 empty at load, so the damaged block is read mid-generation, not before the damage.
    eng = tiered(damaged, MemoryBudget(), prefetch_thread=False, fill_at_load=False)
    tp = eng.experts
    info = tp.ftw.expert_info(*bad)
    with open(damaged, "r+b") as f:
        f.seek(info.data_offset + 7)
        f.write(b"\xff\x00\xff")
    pattern = rf"bad\.ftw: expert block \(layer={bad[0]}, expert={bad[1]}\) at byte offset \d+: checksum"
    with ref.new_session() as a, eng.new_session() as b:
        la, lb = a.prefill(prompt, last_only=True)[0], b.prefill(prompt, last_only=True)[0]
        assert torch.equal(la, lb)
        tok = int(la.argmax())
        for _ in range(1, bad_step):
            x, y = a.decode(tok), b.decode(tok)
            assert torch.equal(x, y)
            tok = int(x.argmax())
        position = b.cached_tokens
        for _ in range(2):  # the step that needs the block fails, cleanly, every time
            with pytest.raises(FTWFormatError, match=pattern):
                b.decode(tok)
            assert b.cached_tokens == position  # no half-written KV left behind
        # Other experts still work: a token whose step does not route to the damaged block.
        for cand in range(ref.spec.vocab_size):
            with a.fork() as probe:
                rec.steps.clear()
                probe.decode(cand)
            if bad not in rec.steps[0]:
                break
        assert torch.equal(a.decode(cand), b.decode(cand))
    tp.close()


def test_anchor_records_the_tiers_and_a_rollback_rewarms_tier_1(built):
    """The bug: the tiered provider had no snapshot_state/restore_state, so an anchor recorded an
    empty expert state and a rollback left tier 1 as the failed continuation had left it."""
    folder, ftw = built("mixtral")
    ref = Engine.from_pretrained(ftw)  # all resident, same weights
    probe = TieredExpertProvider(ftw, MemoryBudget(), top_k=_top_k(ref))
    fast = 8 * ref.kv_pool.bytes_per_block + probe.min_working_set * 2
    budget = MemoryBudget(fast_bytes=fast, host_bytes=sum(probe.stored_bytes.values()))  # all fit in RAM
    eng = tiered(ftw, budget, prefetch=False)
    tp = eng.experts
    ids = _prompt(eng.spec.vocab_size, 12, seed=3)
    with eng.new_session() as s, ref.new_session() as r:
        s.prefill(ids)
        anchor = s.anchor("tool_call")
        at_anchor = tp.snapshot_state()["fast"]
        assert dict(anchor.expert_state)["fast"] == tuple(sorted(at_anchor)) and at_anchor
        tok = 0
        for step in range(40):  # a continuation that routes elsewhere until tier 1 has changed
            s.decode((tok + 7 * step) % eng.spec.vocab_size)
            if not set(at_anchor) <= set(tp.fast.keys()):
                break
        assert not set(at_anchor) <= set(tp.fast.keys()), "the continuation never evicted an anchor expert"
        s.rollback(anchor)
        assert set(at_anchor) <= set(tp.fast.keys())  # back in tier 1, read from RAM, not disk
        assert tp.fast.keys()[-len(at_anchor) :] == at_anchor  # and most recently used, in order
        r.prefill(ids)
        assert torch.equal(s.decode(5), r.decode(5))  # warmth changes nothing in the result
    tp.close()


def test_a_prefetch_finds_a_block_another_load_brought_in_while_it_waited(built):
    """The bug: a prefetch looked in tier 2 before it waited for the link; with two loader threads
    another load of the same block (a prediction dropped, then made again) could read it while
    this one waited, and the block was read twice."""
    _, ftw = built("mixtral")
    tp = TieredExpertProvider(ftw, MemoryBudget(), top_k=2, prefetch=False)
    with FTWFile(ftw) as f:
        elsewhere = BlockReader(f).read(0, 1)  # what the other load read
    tp.reader.link.acquire(urgent=False)  # another read holds the link
    with ThreadPoolExecutor(1) as loader:
        job = loader.submit(tp.moves.prefetch_load, (0, 1), stage=False)
        time.sleep(0.1)  # the prefetch now waits for the link
        with tp.moves.lock:  # meanwhile the other load put the block in tier 2
            tp.host.put((0, 1), elsewhere, tp.stored_bytes[(0, 1)])
        tp.reader.link.release()
        value = job.result(10)
    assert tp.reader.reads == 0
    assert value is elsewhere
    tp.close()


def _counting(container: type) -> type:
    """`container` (a dict or set type) counting, on the class, the keys anyone iterates over."""

    class Counting(container):
        seen = 0

        def __iter__(self):
            for key in super().__iter__():
                Counting.seen += 1
                yield key

    return Counting


def test_a_tier1_miss_looks_at_a_few_keys_not_the_whole_tier():
    """Every tier-1 miss asks `fits` (pinned bytes) and `victims_for`: they summed every pinned
    expert and copied the whole LRU order, ~70 us on a tier 1 of 3,072 Qwen3-30B experts (150
    misses a token at half the experts); now they look at the coldest keys only."""
    t = FastTier[str](1000 * 10)
    for i in range(1000):
        t.put((i // 100, i % 100), "x", 10)
    assert t.set_hot([(9, e) for e in range(50)])  # hot, recently used: pinned
    items, pinned = _counting(OrderedDict), _counting(set)
    t._items, t.pinned = items(t._items), pinned(t.pinned)
    assert t.fits(10, (99, 0)) and not t.has_room(10, (99, 0))
    assert t.victims_for(10, (99, 0)) == [(0, 0)]
    assert t.put((99, 0), "y", 10) == [(0, 0)]
    assert items.seen <= 4 and pinned.seen == 0
    assert t.pinned_bytes() == 50 * 10


def test_filling_a_ranked_tier_ranks_nothing_until_it_is_full():
    """Tier 2 under q* orders evictions by routing frequency; `put` sorted every key by it even
    with room to spare, so filling tier 2 was quadratic (3,000 puts: 4.5 M rank calls, 0.5 s)."""
    ranked: list[ExpertKey] = []

    def rank(key: ExpertKey) -> float:
        ranked.append(key)
        return float(key[1])

    t = HostTier[str](300 * 10, rank=rank)
    for i in range(300):
        assert t.put((i // 8, i % 8), "x", 10) == []
    assert ranked == [] and len(t) == 300
    assert t.put((99, 0), "y", 10) == [(0, 0)]  # full: the lowest rank, least recent among equals
    assert len(ranked) == 300


class CountingFrequency(RoutingFrequency):
    """Routing frequencies that count how often a tier reads them."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads = 0

    def __call__(self, key: ExpertKey) -> float:
        self.reads += 1
        return self.of(key)

    def raw(self, key: ExpertKey) -> float:
        self.reads += 1
        return super().raw(key)


def test_a_routing_ranked_tier_evicts_in_the_sorted_order_without_sorting_it():
    """Tier 2 under q* is ranked by routing frequency: its eviction order is the sort of its keys
    by decayed count, least recent first among equals (the reference below, which sorts), but an
    eviction reads each layer's head, not every key: 2 ms a put at DeepSeek-V3's 8,900 keys when
    it sorted. Random puts, hits, pops, evictions, resizes and routing steps (through counts
    rescaled twice) against the reference."""
    rng = random.Random(7)
    layers, experts = 6, 12
    freq = CountingFrequency(range(layers), decay=0.3)  # rescales every ~290 steps
    protected_keys: set[ExpertKey] = set()
    fast = HostTier[int](30 * 10, rank=freq, protected=protected_keys.__contains__)
    ref = HostTier[int](30 * 10, rank=lambda k: freq.of(k), protected=protected_keys.__contains__)
    keys = [(lay, e) for lay in range(layers) for e in range(experts)]
    for step in range(700):
        for lay in range(layers):
            freq.note(lay, rng.sample(range(experts), rng.choice([0, 1, 2])))
        protected_keys.clear()
        protected_keys.update(rng.sample(keys, 3))
        for _ in range(3):
            key, op = rng.choice(keys), rng.random()
            if op < 0.45:
                assert fast.put(key, step, 10) == ref.put(key, step, 10)
            elif op < 0.7:
                assert fast.get(key) == ref.get(key)
            elif op < 0.8:
                assert fast.pop(key) == ref.pop(key)
            elif op < 0.9:
                nbytes = rng.choice([10, 20, 40])
                assert fast.victims_for(nbytes) == ref.victims_for(nbytes)
            elif op < 0.97:
                assert fast.evict_coldest() == ref.evict_coldest()
            else:
                cap = rng.choice([20, 25, 30]) * 10
                assert fast.resize(cap) == ref.resize(cap)
        assert fast.keys() == ref.keys()
    assert freq.epoch(0) >= 2
    assert list(fast.eviction_order()) == list(ref.eviction_order())

    # A tier of 2,400 keys: filling it reads no rank; the first eviction orders the tier once
    # and each later one reads a few entries per layer, not every key.
    freq = CountingFrequency(range(40), decay=0.99)
    for lay in range(40):
        freq.note(lay, range(0, 60, 3))
    big = HostTier[int](2400 * 10, rank=freq)
    for lay in range(40):
        for e in range(60):
            big.put((lay, e), 0, 10)
    assert freq.reads == 0
    assert big.put((39, 60), 0, 10) == [(0, 1)]  # never routed, least recent
    freq.reads = 0
    assert big.put((39, 61), 0, 10) == [(0, 2)]
    assert freq.reads < 200


def test_pinned_bytes_follow_every_change_of_the_tier():
    rng = random.Random(0)
    t = FastTier[str](400, max_pinned_fraction=0.5)
    for step in range(2000):
        key = (rng.randrange(4), rng.randrange(8))
        op = rng.randrange(6)
        if op == 0:
            t.put(key, "x", rng.choice((10, 20, 30)))
        elif op == 1:
            t.pin(key)
        elif op == 2:
            t.unpin(key)
        elif op == 3:
            t.pop(key)
        elif op == 4:
            t.set_hot([(rng.randrange(4), rng.randrange(8)) for _ in range(6)])
        else:
            t.resize(rng.choice((200, 300, 400)))
        assert t.pinned_bytes() == sum(t._items[k][1] for k in t.pinned), step
        assert t.pinned <= set(t._items)
