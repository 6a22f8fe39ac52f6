"""Paged KV cache: fixed-size blocks shared by refcount, one block table per session.

A block holds `block_size` consecutive token positions for *every* layer, so one block table
describes a whole session. Blocks are refcounted: `fork()` and anchors share blocks instead of
copying them, and a write into a shared (partial) block copies it first (copy-on-write). Only the
last block of a sequence can be partial, so only it is ever copied. Truncation and fork are
O(number of blocks), never O(tokens x dims).

Each layer stores one or more named *streams* of per-token features: GQA layers store
`k [n_kv, head_dim]` and `v [n_kv, head_dim]`; MLA layers store the compressed `latent [kv_lora]`
and the shared rotary key `k_rope [rope_dim]` (never the expanded K/V).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import MemoryBudgetError

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class StreamSpec:
    """One cached per-token tensor of one layer: `name` and its per-token `shape`."""

    name: str
    shape: tuple[int, ...]


class BlockPool:
    """Storage for KV blocks of all layers, with refcounts and a free list.

    Storage for layer l, stream s is a tensor `[capacity, block_size, *shape]`. Capacity grows
    geometrically when the free list runs dry (up to `max_blocks`, if set).
    """

    def __init__(
        self,
        layer_streams: Sequence[Sequence[StreamSpec]],
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        initial_blocks: int = 16,
        max_blocks: int | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_blocks = max_blocks
        self.layer_streams = [tuple(streams) for streams in layer_streams]
        self.capacity = 0
        self.storage: list[dict[str, torch.Tensor]] = [{} for _ in self.layer_streams]
        self.refcount: list[int] = []
        self._free: list[int] = []
        self._grow(initial_blocks if max_blocks is None else min(initial_blocks, max_blocks))

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies across all layers and streams."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_token = sum(_numel(s.shape) for streams in self.layer_streams for s in streams)
        return per_token * self.block_size * elem

    @property
    def blocks_in_use(self) -> int:
        return self.capacity - len(self._free)

    def _grow(self, new_blocks: int) -> None:
        old = self.capacity
        new_capacity = old + new_blocks
        for layer, streams in enumerate(self.layer_streams):
            for spec in streams:
                fresh = torch.zeros(
                    (new_capacity, self.block_size, *spec.shape), dtype=self.dtype, device=self.device
                )
                if old:
                    fresh[:old].copy_(self.storage[layer][spec.name])
                self.storage[layer][spec.name] = fresh
        self.refcount.extend([0] * new_blocks)
        # Pop from the end: lower ids first keeps block order readable in tests and logs.
        self._free.extend(reversed(range(old, new_capacity)))
        self.capacity = new_capacity

    def allocate(self) -> int:
        """Take a free block (refcount 1), growing the pool when needed."""
        if not self._free:
            grow = max(self.capacity, 16)
            if self.max_blocks is not None:
                grow = min(grow, self.max_blocks - self.capacity)
                if grow <= 0:
                    raise MemoryBudgetError(
                        f"KV cache is full: all {self.max_blocks} blocks of {self.block_size} tokens "
                        f"({self.max_blocks * self.bytes_per_block} bytes) are in use"
                    )
            self._grow(grow)
        block = self._free.pop()
        self.refcount[block] = 1
        return block

    def incref(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.refcount[b] += 1

    def decref(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            count = self.refcount[b] - 1
            if count < 0:
                raise RuntimeError(f"KV block {b} released more often than it was taken")
            self.refcount[b] = count
            if count == 0:
                self._free.append(b)

    def copy_block(self, src: int) -> int:
        """A new private block holding a copy of `src` (all layers); used for copy-on-write."""
        dst = self.allocate()
        for layer_storage in self.storage:
            for tensor in layer_storage.values():
                tensor[dst].copy_(tensor[src])
        return dst

    def flat(self, layer: int, name: str) -> torch.Tensor:
        """Layer storage viewed as `[capacity * block_size, *shape]` (slot-addressed)."""
        t = self.storage[layer][name]
        return t.view(t.shape[0] * t.shape[1], *t.shape[2:])


class BlockTable:
    """One sequence's view of the pool: the ordered block ids and the number of tokens in them.

    It keeps the slot index (block * block_size + offset) of every position, so reads and
    writes are a single gather/scatter per stream.
    """

    def __init__(self, pool: BlockPool, blocks: list[int] | None = None, length: int = 0) -> None:
        self.pool = pool
        self.blocks: list[int] = list(blocks or [])
        self.length = length
        self._slots = self._slots_for(0, length)

    def _slots_for(self, start: int, stop: int) -> torch.Tensor:
        bs = self.pool.block_size
        pos = torch.arange(start, stop)
        ids = torch.tensor(self.blocks, dtype=torch.long) if self.blocks else torch.empty(0, dtype=torch.long)
        return ids[pos // bs] * bs + pos % bs if stop > start else torch.empty(0, dtype=torch.long)

    @property
    def slots(self) -> torch.Tensor:
        """Slot indices of positions [0, length)."""
        return self._slots

    def reserve(self, n_new: int) -> torch.Tensor:
        """Make room for `n_new` more tokens; return their slots. Shared partial blocks are copied."""
        bs = self.pool.block_size
        start, stop = self.length, self.length + n_new
        if start % bs and self.pool.refcount[self.blocks[-1]] > 1:
            shared = self.blocks[-1]
            self.blocks[-1] = self.pool.copy_block(shared)
            self.pool.decref([shared])
            # The shared block's positions now live in the private copy.
            self._slots = self._slots_for(0, start)
        while len(self.blocks) * bs < stop:
            self.blocks.append(self.pool.allocate())
        new_slots = self._slots_for(start, stop)
        self._slots = torch.cat([self._slots, new_slots])
        self.length = stop
        return new_slots

    def truncate(self, length: int) -> None:
        """Keep positions [0, length): release whole blocks past it. O(blocks)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a sequence of {self.length} tokens to {length}")
        keep = -(-length // self.pool.block_size)
        self.pool.decref(self.blocks[keep:])
        del self.blocks[keep:]
        self.length = length
        self._slots = self._slots[:length]

    def fork(self) -> BlockTable:
        """A second table sharing every block (refcounts +1); writes diverge by copy-on-write."""
        self.pool.incref(self.blocks)
        twin = BlockTable.__new__(BlockTable)
        twin.pool, twin.blocks, twin.length, twin._slots = (
            self.pool,
            list(self.blocks),
            self.length,
            self._slots,
        )
        return twin

    def release(self) -> None:
        """Give every block back; the table is empty afterwards."""
        self.pool.decref(self.blocks)
        self.blocks = []
        self.length = 0
        self._slots = self._slots[:0]

    def write(self, layer: int, name: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store `values [n, *shape]` at `slots [n]` of one layer's stream."""
        self.pool.flat(layer, name).index_copy_(0, slots, values.to(self.pool.dtype))

    def read(self, layer: int, name: str) -> torch.Tensor:
        """All cached positions of one stream: `[length, *shape]` (a gathered copy)."""
        return self.pool.flat(layer, name).index_select(0, self._slots)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
