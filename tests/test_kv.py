"""Paged KV cache: refcounts, copy-on-write, truncate and fork in O(blocks)."""

from __future__ import annotations

import pytest
import torch

from freetoken_agents.engine import MemoryBudgetError
from freetoken_agents.engine.model.kv import BlockPool, BlockTable, StreamSpec


def _pool(**kw) -> BlockPool:
    return BlockPool([(StreamSpec("k", (2, 3)),), (StreamSpec("k", (2, 3)),)], block_size=4, **kw)


def _fill(table: BlockTable, start: int, n: int) -> None:
    slots = table.reserve(n)
    for layer in range(2):
        values = (
            torch.arange(start, start + n, dtype=torch.float32)[:, None, None].expand(n, 2, 3) + 100 * layer
        )
        table.write(layer, "k", slots, values)


def _positions(table: BlockTable, layer: int = 0) -> list[int]:
    return table.read(layer, "k")[:, 0, 0].long().tolist()


def test_blocks_and_slots():
    table = BlockTable(_pool())
    _fill(table, 0, 10)
    assert len(table.blocks) == 3 and table.length == 10
    assert _positions(table) == list(range(10))
    assert _positions(table, 1) == [p + 100 for p in range(10)]


def test_fork_shares_blocks_and_copies_partial_block_on_write():
    pool = _pool()
    parent = BlockTable(pool)
    _fill(parent, 0, 6)  # blocks: [0..3], [4, 5, _, _]
    child = parent.fork()
    assert child.blocks == parent.blocks
    assert all(pool.refcount[b] == 2 for b in parent.blocks)
    _fill(child, 6, 3)  # writes into the shared partial block -> copied
    assert child.blocks[0] == parent.blocks[0] and child.blocks[1] != parent.blocks[1]
    assert pool.refcount[parent.blocks[1]] == 1
    assert _positions(parent) == list(range(6))
    assert _positions(child) == list(range(9))


def test_truncate_releases_whole_blocks_only():
    pool = _pool()
    table = BlockTable(pool)
    _fill(table, 0, 12)
    used = pool.blocks_in_use
    table.truncate(5)
    assert table.length == 5 and len(table.blocks) == 2
    assert pool.blocks_in_use == used - 1
    _fill(table, 50, 3)
    assert _positions(table) == [0, 1, 2, 3, 4, 50, 51, 52]
    with pytest.raises(ValueError):
        table.truncate(9)


def test_release_returns_every_block():
    pool = _pool()
    a = BlockTable(pool)
    _fill(a, 0, 9)
    b = a.fork()
    a.release()
    assert pool.blocks_in_use == len(b.blocks)
    b.release()
    assert pool.blocks_in_use == 0


def test_pool_grows_and_keeps_data():
    pool = _pool(initial_blocks=1)
    table = BlockTable(pool)
    _fill(table, 0, 40)
    assert pool.capacity >= 10
    assert _positions(table) == list(range(40))


def test_bounded_pool_raises_memory_budget_error():
    pool = _pool(initial_blocks=2, max_blocks=2)
    table = BlockTable(pool)
    _fill(table, 0, 8)
    with pytest.raises(MemoryBudgetError, match="KV cache is full"):
        table.reserve(1)
