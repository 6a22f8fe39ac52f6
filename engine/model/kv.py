"""Paged KV cache: fixed-size blocks shared by refcount, one block table per session.

A block holds `block_size` consecutive token positions for *every* layer, so one block table
describes a whole session. Blocks are refcounted: `fork()` and anchors share blocks instead of
copying them, and a write into a shared (partial) block copies it first (copy-on-write). Only the
last block of a sequence can be partial, so only it is ever copied. Truncation and fork are
O(number of blocks), never O(tokens x dims).

Read-only pins (`BlockTable.pin()`, what anchors hold) never write, so they do not force a copy:
the one writing table may keep appending into a partial block it shares with pins, past their
length, as long as nobody else has written there (the block's `filled` frontier is its own
length). Twenty anchors along one branch therefore cost no extra blocks.

Integrity: every table keeps a chained digest of its full blocks, computed once when a block
fills (`seal_full_blocks`, called after each forward step): `chain[i] = sha256(chain[i-1] ||
xxh3_128(block i))`. The block bytes are hashed layer by layer, stream by stream, in storage
order. Anchors build their identity on it without rehashing the cache.

Each layer stores one or more named *streams* of per-token features: GQA layers store
`k [n_kv, head_dim]` and `v [n_kv, head_dim]`; MLA layers store the compressed `latent [kv_lora]`
and the shared rotary key `k_rope [rope_dim]` (never the expanded K/V).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import xxhash

from ..errors import MemoryBudgetError

DEFAULT_BLOCK_SIZE = 16
CHAIN_SEED = hashlib.sha256(b"freetoken-kv-chain-v1").digest()  # chain value before block 0


@dataclass(frozen=True)
class StreamSpec:
    """One cached per-token tensor of one layer: `name` and its per-token `shape`."""

    name: str
    shape: tuple[int, ...]


class BlockPool:
    """Storage for KV blocks of all layers, with refcounts and a free list.

    Storage for layer l, stream s is a tensor `[capacity, block_size, *shape]`. Capacity grows
    geometrically when the free list runs dry (up to `max_blocks`, if set). When a bounded pool is
    full, `reclaim` (if given; the engine passes its anchor store's) is called until it frees a
    block or returns False, before MemoryBudgetError is raised. `on_resize` (if given; the engine
    passes a tiered expert provider's) hears of every change of the KV bytes in use.

    Per block: `refcount` (tables holding it), `pins` (how many of those are read-only pins) and
    `filled` (one past the highest offset any writer reserved in it). Counters for tests and
    benchmarks: `digest_calls` / `digested_bytes` (block hashing), `copied_bytes` (copy-on-write).
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
        reclaim: Callable[[], bool] | None = None,
        on_resize: Callable[[int], None] | None = None,
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
        self.pins: list[int] = []
        self.filled: list[int] = []
        self._free: list[int] = []
        self.reclaim = reclaim
        # Called with the KV bytes in use (blocks in use x bytes_per_block) before a block is taken
        # and after blocks are freed, so a shared fast budget can shrink/regrow the expert tier.
        # It may raise MemoryBudgetError to refuse a block; the pool is then unchanged.
        self.on_resize = on_resize
        self.digest_calls = 0
        self.digested_bytes = 0
        self.copied_bytes = 0
        self._flat_views: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._grow(initial_blocks if max_blocks is None else min(initial_blocks, max_blocks))

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies across all layers and streams."""
        return bytes_per_block(self.layer_streams, self.block_size, self.dtype)

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
        self.pins.extend([0] * new_blocks)
        self.filled.extend([0] * new_blocks)
        # Pop from the end: lower ids first keeps block order readable in tests and logs.
        self._free.extend(reversed(range(old, new_capacity)))
        self.capacity = new_capacity
        self._flat_views.clear()  # they view the replaced storage

    def allocate(self, prefer: int | None = None) -> int:
        """Take a free block (refcount 1), growing the pool when needed: `prefer` if it is free
        (a table asks for the block after its last one, so its blocks stay one contiguous run
        that decode attention reads in place), else the lowest free id."""
        while not self._free and self.max_blocks is not None and self.capacity >= self.max_blocks:
            if self.reclaim is None or not self.reclaim():
                break
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
        if self.on_resize is not None:
            self.on_resize((self.blocks_in_use + 1) * self.bytes_per_block)
        block = self._take_free(prefer)
        self.refcount[block] = 1
        self.pins[block] = 0
        self.filled[block] = 0
        return block

    def _take_free(self, prefer: int | None) -> int:
        if prefer is not None and prefer < self.capacity and self.refcount[prefer] == 0:
            try:
                self._free.remove(prefer)
                return prefer
            except ValueError:
                pass
        return self._free.pop()

    def incref(self, blocks: Sequence[int], *, pin: bool = False) -> None:
        """Take one more reference to each block (`pin`: a read-only one)."""
        for b in blocks:
            self.refcount[b] += 1
            self.pins[b] += pin

    def decref(self, blocks: Sequence[int], *, pin: bool = False) -> None:
        """Drop one reference to each block (`pin`: a read-only one); free blocks nobody holds."""
        for b in blocks:
            count = self.refcount[b] - 1
            if count < 0 or (pin and self.pins[b] <= 0):
                raise RuntimeError(f"KV block {b} released more often than it was taken")
            self.refcount[b] = count
            self.pins[b] -= pin
            if count == 0:
                self._free.append(b)
        if blocks:
            self.shrink()
        if self.on_resize is not None and blocks:
            self.on_resize(self.blocks_in_use * self.bytes_per_block)

    def shrink(self, min_blocks: int = 16, *, slack: float = 0.5) -> int:
        """Release storage of trailing free blocks; returns the bytes released (0: nothing done).

        Only the free run at the END of the pool is released (block ids of live tables never
        change, nothing is moved between slots), and only when that run is at least `slack` of the
        capacity, so grow/shrink cannot ping-pong and the copy of the live prefix is amortised by
        the growth that preceded it. Capacity never drops below `min_blocks`. Called by `decref`.
        Free blocks in the middle of the pool stay allocated (compacting them would renumber
        blocks that tables and pins hold).
        """
        keep = self.capacity
        while keep > min_blocks and self.refcount[keep - 1] == 0:
            keep -= 1
        if keep == self.capacity or self.capacity - keep < slack * self.capacity:
            return 0
        for layer_storage in self.storage:
            for name, tensor in layer_storage.items():
                layer_storage[name] = tensor[:keep].clone()
        released = (self.capacity - keep) * self.bytes_per_block
        del self.refcount[keep:], self.pins[keep:], self.filled[keep:]
        self._free = [b for b in self._free if b < keep]
        self.capacity = keep
        self._flat_views.clear()
        return released

    def copy_block(self, src: int) -> int:
        """A new private block holding a copy of `src` (all layers); used for copy-on-write."""
        dst = self.allocate()
        for layer_storage in self.storage:
            for tensor in layer_storage.values():
                tensor[dst].copy_(tensor[src])
        self.filled[dst] = self.filled[src]
        self.copied_bytes += self.bytes_per_block
        return dst

    def digest_block(self, block: int, n_tokens: int | None = None) -> bytes:
        """xxh3-128 of the first `n_tokens` positions (default: all) of `block`, all layers.

        Bytes are hashed layer by layer, stream by stream (in `layer_streams` order), each stream's
        `[n_tokens, *shape]` slice in C order. Not cryptographic: it guards against corruption.
        """
        n = self.block_size if n_tokens is None else n_tokens
        h = xxhash.xxh3_128()
        for layer_storage in self.storage:
            for tensor in layer_storage.values():
                data = tensor_bytes(tensor[block, :n])
                h.update(data)
                self.digested_bytes += len(data)
        self.digest_calls += 1
        return h.digest()

    def flat(self, layer: int, name: str) -> torch.Tensor:
        """Layer storage viewed as `[capacity * block_size, *shape]` (slot-addressed); the view
        is kept until the storage is replaced (growth, shrink): decode asks per layer per token."""
        t = self.storage[layer][name]
        hit = self._flat_views.get((layer, name))
        if hit is not None and hit[0] is t:
            return hit[1]
        with torch.inference_mode(False):  # a normal view, writable in and out of inference mode
            view = t.view(t.shape[0] * t.shape[1], *t.shape[2:])
        self._flat_views[(layer, name)] = (t, view)
        return view


class BlockTable:
    """One sequence's view of the pool: the ordered block ids and the number of tokens in them.

    It keeps the slot index (block * block_size + offset) of every position, so reads and
    writes are a single gather/scatter per stream, and `chain`: the chained digests of its full
    blocks that `seal_full_blocks` has hashed (`chain[i]` covers blocks 0..i).
    """

    def __init__(self, pool: BlockPool, blocks: list[int] | None = None, length: int = 0) -> None:
        self.pool = pool
        self.blocks: list[int] = list(blocks or [])
        self.length = length
        self.read_only = False
        self.chain: list[bytes] = []
        self._slots = self._slots_for(0, length)

    def _slots_for(self, start: int, stop: int) -> torch.Tensor:
        bs = self.pool.block_size
        device = self.pool.device
        if stop <= start:
            return torch.empty(0, dtype=torch.long, device=device)
        pos = torch.arange(start, stop, device=device)
        ids = torch.tensor(self.blocks, dtype=torch.long, device=device)
        return ids[pos // bs] * bs + pos % bs

    @property
    def slots(self) -> torch.Tensor:
        """Slot indices of positions [0, length)."""
        return self._slots

    def reserve(self, n_new: int) -> torch.Tensor:
        """Make room for `n_new` more tokens; return their slots. Shared partial blocks are copied."""
        if self.read_only:
            raise RuntimeError("a pinned (read-only) block table cannot grow; fork() it first")
        pool, bs = self.pool, self.pool.block_size
        start, stop = self.length, self.length + n_new
        offset = start % bs
        if offset and self._must_copy(self.blocks[-1], offset):
            shared = self.blocks[-1]
            self.blocks[-1] = pool.copy_block(shared)
            pool.decref([shared])
            # The shared block's positions now live in the private copy.
            self._slots = self._slots_for(0, start)
        while len(self.blocks) * bs < stop:
            self.blocks.append(pool.allocate(prefer=self.blocks[-1] + 1 if self.blocks else None))
        for i in range(start // bs, len(self.blocks)):
            b = self.blocks[i]
            pool.filled[b] = max(pool.filled[b], min(bs, stop - i * bs))
        new_slots = self._slots_for(start, stop)
        self._slots = torch.cat([self._slots, new_slots])
        self.length = stop
        return new_slots

    def _must_copy(self, block: int, offset: int) -> bool:
        """Whether writing from `offset` into `block` could change what another holder reads."""
        pool = self.pool
        if pool.refcount[block] == 1:
            return False
        other_writers = pool.refcount[block] - pool.pins[block] - 1
        # Pins read only below their own length; if nobody reserved past `offset`, appending
        # here leaves every pinned position untouched.
        return other_writers > 0 or pool.filled[block] != offset

    def truncate(self, length: int) -> None:
        """Keep positions [0, length): release whole blocks past it. O(blocks)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a sequence of {self.length} tokens to {length}")
        keep = -(-length // self.pool.block_size)
        self.pool.decref(self.blocks[keep:], pin=self.read_only)
        del self.blocks[keep:]
        del self.chain[length // self.pool.block_size :]
        self.length = length
        self._slots = self._slots[:length]

    def fork(self) -> BlockTable:
        """A second (writable) table sharing every block (refcounts +1); writes diverge by
        copy-on-write. Forking a pin is how a session rolls back to it."""
        self.pool.incref(self.blocks)
        return self._twin(read_only=False)

    def pin(self) -> BlockTable:
        """A read-only table sharing every block: it keeps [0, length) alive and unchanged
        without forcing the writer to copy the partial last block. O(blocks)."""
        self.seal_full_blocks()
        self.pool.incref(self.blocks, pin=True)
        return self._twin(read_only=True)

    def _twin(self, *, read_only: bool) -> BlockTable:
        twin = BlockTable.__new__(BlockTable)
        twin.pool, twin.blocks, twin.length = self.pool, list(self.blocks), self.length
        twin._slots, twin.read_only, twin.chain = self._slots, read_only, list(self.chain)
        return twin

    def release(self) -> None:
        """Give every block back; the table is empty afterwards."""
        self.pool.decref(self.blocks, pin=self.read_only)
        self.blocks = []
        self.chain = []
        self.length = 0
        self._slots = self._slots[:0]

    def seal_full_blocks(self) -> int:
        """Digest the full blocks not yet in `chain` (each block once); returns how many."""
        full = self.length // self.pool.block_size
        sealed = 0
        while len(self.chain) < full:
            prev = self.chain[-1] if self.chain else CHAIN_SEED
            digest = self.pool.digest_block(self.blocks[len(self.chain)])
            self.chain.append(hashlib.sha256(prev + digest).digest())
            sealed += 1
        return sealed

    def write(self, layer: int, name: str, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store `values [n, *shape]` at `slots [n]` of one layer's stream."""
        if values.dtype != self.pool.dtype:
            values = values.to(self.pool.dtype)
        self.pool.flat(layer, name).index_copy_(0, slots, values)

    def read(self, layer: int, name: str) -> torch.Tensor:
        """All cached positions of one stream: `[length, *shape]` (a gathered copy)."""
        return self.pool.flat(layer, name).index_select(0, self._slots)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of `t` in C order (on the host; any dtype, bf16 included)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def bytes_per_block(
    layer_streams: Sequence[Sequence[StreamSpec]], block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one KV block of `block_size` tokens occupies across all layers and streams."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = sum(_numel(s.shape) for streams in layer_streams for s in streams)
    return per_token * block_size * elem


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
