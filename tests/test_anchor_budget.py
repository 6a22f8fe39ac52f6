"""The anchor store's default budgets: anchor-only KV bounded by a budget that scales with the model
(half the KV budget when one is set, else four contexts' KV, at most 256 MiB), records bounded by
a metadata budget, expert-cache states stored once; and the store used from many threads."""

from __future__ import annotations

import threading
import tracemalloc

import pytest

from freetoken_agents.engine import Engine, MemoryBudget
from freetoken_agents.engine.anchors.store import DEFAULT_BYTE_CAP, RECORD_OVERHEAD, default_byte_budget

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 500 + 5 for i in range(n)]


def branch_anchors(engine: Engine, count: int, base: int = 40) -> None:
    """`count` anchors, each on a branch of its own: a shared prefix, then two tokens of its own
    (its partial last block is a copy only the anchor keeps once the session moves on)."""
    with engine.new_session() as s:
        s.prefill(ids(base, 1))
        for i in range(count):
            s.truncate(base)
            s.prefill([5 + i % 400, 7 + i % 300])
            s.anchor("tool_call")


def test_the_default_byte_budget_scales_with_the_model(folder) -> None:
    engine = Engine.from_pretrained(folder)
    pool = engine.kv_pool
    four_contexts = 4 * -(-engine.max_context // pool.block_size) * pool.bytes_per_block
    assert (
        engine.anchors.byte_budget
        == default_byte_budget(engine.anchors.host)
        == min(four_contexts, DEFAULT_BYTE_CAP)
    )
    bounded = Engine.from_pretrained(folder, memory=MemoryBudget(kv_bytes=40 * pool.bytes_per_block))
    assert bounded.anchors.byte_budget == 20 * pool.bytes_per_block  # half the KV budget


def test_anchors_on_abandoned_branches_stay_within_the_default_budget(folder) -> None:
    """The bug: no default budget, so every anchor's own partial block stayed alive (2,000 anchors
    on the embedded model: +98 MB of KV). Now the coldest are evicted past the budget."""
    engine = Engine.from_pretrained(folder)
    budget, block = engine.anchors.byte_budget, engine.kv_pool.bytes_per_block
    branch_anchors(engine, 400)
    assert engine.anchors.used_bytes <= budget and engine.anchors.evictions > 0
    assert engine.kv_pool.blocks_in_use <= budget // block  # the sessions closed: anchors' blocks only
    assert len(engine.anchors) <= budget // block


def test_records_are_bounded_by_the_metadata_budget_and_share_expert_states(folder) -> None:
    engine = Engine.from_pretrained(folder)
    store = engine.anchors
    store.byte_budget = None
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        branch_anchors(engine, 200, base=100)
        per_record = (tracemalloc.get_traced_memory()[0] - before) / 200
    finally:
        tracemalloc.stop()
    record = 8 * 102 + RECORD_OVERHEAD
    assert store.metadata_bytes == 200 * record
    assert per_record < 1.5 * record  # the estimate is what a record costs (the expert state is shared)
    states = {id(a.expert_state) for a in store}
    assert len(states) == 1 and len(next(iter(store)).expert_state) > 0  # one object for one state
    store.metadata_budget = 50 * record
    assert len(store) == 50 and store.metadata_bytes == 50 * record
    store.clear()
    assert store.metadata_bytes == 0 and not store._states and not store._holders


def test_a_full_pool_reclaims_cold_anchors_of_an_unbounded_store(folder) -> None:
    block = Engine.from_pretrained(folder).kv_pool.bytes_per_block
    engine = Engine.from_pretrained(folder, memory=MemoryBudget(kv_bytes=8 * block))
    engine.anchors.byte_budget = None  # only the pool's own reclaim bounds the anchors
    branch_anchors(engine, 6, base=20)
    assert len(engine.anchors) == 6
    with engine.new_session() as s:
        s.prefill(ids(100, 3))  # 7 blocks: the pool reclaims anchors until they fit
    assert len(engine.anchors) < 6 and engine.anchors.evictions > 0


def test_the_store_is_safe_to_use_from_many_threads(folder) -> None:
    engine = Engine.from_pretrained(folder)
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def work(seed: int) -> None:
        try:
            start.wait()
            for i in range(15):
                with engine.new_session() as s:
                    s.prefill(ids(20 + i, seed))
                    a = s.anchor("manual")
                    engine.anchors.pin(a.id)
                    assert engine.anchors.get(a.id) is not None
                    engine.anchors.unpin(a.id)
                    list(engine.anchors)
                    engine.anchors.discard(a.id)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(engine.anchors) == 0 and engine.kv_pool.blocks_in_use == 0
    assert not engine.anchors._holders and engine.anchors.metadata_bytes == 0
