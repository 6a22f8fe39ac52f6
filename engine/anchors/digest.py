"""The digests behind anchor identity and validation, and the model fingerprint.

Everything here is deterministic and versioned by `FORMAT_VERSION`, which is hashed into the model
fingerprint and into every anchor id (so a format change can never alias an old anchor).

- `token_bytes`: token ids as fixed-width little-endian int64, concatenated.
- `kv_digest(table)`: `sha256("ftkv" || chain[n_full - 1] || le64(length) || partial)`, where
  `chain` is the table's chained digest of its full blocks (computed once per block when it
  fills, see `engine.kv`) and `partial` the xxh3-128 of the filled positions of the partial last
  block (at most `block_size` tokens). Cost: O(block_size), independent of the context length.
- `rehash_kv(table)`: the same digest recomputed from the KV bytes of every block the table
  covers (O(context), xxh3 over zero-copy row views of the pool: ~memory bandwidth on CPU; on
  another device the covered blocks are first gathered to the host, one copy per stream).
- `signature_edges(table)`: sha256 of the first and the last `SIGNATURE_SPAN` bytes of the
  table's *KV byte stream*: layer 0's first stream for positions 0, 1, ... then its next stream,
  ..., up to the last layer's last stream ending at the last position; each position's vector
  in C order. Head and tail are read with one small gather per stream touched.
- `model_fingerprint(...)`: see its docstring (every byte of the weights, `weights.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash

from ..loading.fingerprint import weights_digest
from ..model.kv import CHAIN_SEED, BlockPool, BlockTable, tensor_bytes
from ..text.tokenizer_files import TOKENIZER_FILES

if TYPE_CHECKING:
    from ..model.experts import ExpertStore
    from ..spec import ModelSpec

FORMAT_VERSION = 2  # engine anchor format: fingerprint, id and save-file layout (2: full-weight
# fingerprint, authenticated save files)
SIGNATURE_SPAN = 512  # bytes taken from each end of the KV byte stream


def le64(n: int) -> bytes:
    return int(n).to_bytes(8, "little", signed=True)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as fixed-width little-endian int64 (8 bytes per token)."""
    return np.asarray(token_ids, dtype="<i8").tobytes()


def token_hash(token_ids: Sequence[int]) -> str:
    """sha256 hex of the token prefix (length-prefixed `token_bytes`)."""
    return hashlib.sha256(b"fttok" + le64(len(token_ids)) + token_bytes(token_ids)).hexdigest()


def expert_state_bytes(state: Iterable[tuple[str, Iterable[tuple[int, int]]]]) -> bytes:
    """Canonical bytes of an expert-cache state: compact JSON `[[tier, [[layer, expert], ...]], ...]`."""
    doc = [[tier, [[int(layer), int(expert)] for layer, expert in keys]] for tier, keys in state]
    return json.dumps(doc, separators=(",", ":")).encode()


def anchor_id(
    fingerprint: str, token_ids: Sequence[int], kv_digest_hex: str, state: Iterable[tuple[str, Iterable]]
) -> str:
    """`sha256(model_fingerprint || token ids || kv_digest || expert_state)` as 64 hex chars.

    A domain tag and the format version lead; the two variable-length parts are length-prefixed
    (le64), so distinct inputs never produce the same byte string.
    """
    es = expert_state_bytes(state)
    h = hashlib.sha256(b"freetoken-anchor\0" + le64(FORMAT_VERSION))
    h.update(bytes.fromhex(fingerprint))
    h.update(le64(len(token_ids)) + token_bytes(token_ids))
    h.update(bytes.fromhex(kv_digest_hex))
    h.update(le64(len(es)) + es)
    return h.hexdigest()


# ---- KV digests ---------------------------------------------------------------------------------
def _finish(table: BlockTable, chain_value: bytes) -> str:
    pool, bs = table.pool, table.pool.block_size
    rem = table.length % bs
    partial = pool.digest_block(table.blocks[table.length // bs], rem) if rem else b""
    return hashlib.sha256(b"ftkv" + chain_value + le64(table.length) + partial).hexdigest()


def kv_digest(table: BlockTable) -> str:
    """Digest of positions [0, length) from the table's sealed chain plus the partial block."""
    table.seal_full_blocks()
    full = table.length // table.pool.block_size
    return _finish(table, table.chain[full - 1] if full else CHAIN_SEED)


def rehash_kv(table: BlockTable, *, gather: bool | None = None) -> tuple[str, int | None]:
    """(`kv_digest` recomputed from the KV bytes of every block the table covers, index of the first
    full block whose recomputed chain differs from the table's stored `chain`, or None).

    Computes exactly what `BlockPool.digest_block` and the chain compute, from row views of the
    pool (no per-block tensor slicing): one xxh3-128 per block over its rows, layer by layer,
    stream by stream, in storage order. `gather`: copy the covered blocks to the host first
    (default: only when the pool is not on the CPU)."""
    pool, bs = table.pool, table.pool.block_size
    full, rem = divmod(table.length, bs)
    covered = table.blocks[: full + (1 if rem else 0)]
    rows = _block_rows(pool, covered, pool.device.type != "cpu" if gather is None else gather)
    value, first_bad = CHAIN_SEED, None
    for i in range(full):
        h = xxhash.xxh3_128()
        for array, ids in rows:
            h.update(array[ids[i]])
        value = hashlib.sha256(value + h.digest()).digest()
        if first_bad is None and (i >= len(table.chain) or table.chain[i] != value):
            first_bad = i
    partial = b""
    if rem:
        h = xxhash.xxh3_128()
        for array, ids in rows:
            h.update(array[ids[full]][: array.shape[1] // bs * rem])
        partial = h.digest()
    return hashlib.sha256(b"ftkv" + value + le64(table.length) + partial).hexdigest(), first_bad


def _block_rows(
    pool: BlockPool, blocks: Sequence[int], gather: bool
) -> list[tuple[np.ndarray, Sequence[int]]]:
    """Per layer and stream (storage order): (uint8 array with one row per block, the row of each of
    `blocks`). On the CPU the array is a view of the pool's storage (the rows are the block ids);
    with `gather` it is one host copy of the gathered blocks (the rows are 0, 1, ...)."""
    out: list[tuple[np.ndarray, Sequence[int]]] = []
    if not blocks:
        return out
    ids = list(blocks)
    for layer_storage in pool.storage:
        for tensor in layer_storage.values():
            if not gather and tensor.device.type == "cpu" and tensor.is_contiguous():
                out.append((tensor.view(tensor.shape[0], -1).view(torch.uint8).numpy(), ids))
            else:
                gathered = tensor.index_select(0, torch.tensor(ids, device=tensor.device))
                host = gathered.reshape(len(ids), -1).contiguous().cpu().view(torch.uint8).numpy()
                out.append((host, range(len(ids))))
    return out


def _edge(table: BlockTable, span: int, *, from_end: bool) -> bytes:
    pool, n = table.pool, table.length
    elem = pool.storage[0][pool.layer_streams[0][0].name].element_size() if n else 0
    order = [(layer, spec) for layer, streams in enumerate(pool.layer_streams) for spec in streams]
    if from_end:
        order.reverse()
    parts: list[bytes] = []
    need = span if n else 0
    for layer, spec in order:
        if need <= 0:
            break
        per_token = max(1, math.prod(spec.shape) * elem)
        k = min(n, -(-need // per_token))
        slots = table.slots[n - k :] if from_end else table.slots[:k]
        data = bytes(tensor_bytes(pool.flat(layer, spec.name).index_select(0, slots)))
        take = min(need, len(data))
        parts.append(data[len(data) - take :] if from_end else data[:take])
        need -= take
    if from_end:
        parts.reverse()
    return b"".join(parts)


def signature_edges(table: BlockTable, span: int = SIGNATURE_SPAN) -> str:
    """sha256 hex of the first and last `span` bytes of the table's KV byte stream."""
    head, tail = _edge(table, span, from_end=False), _edge(table, span, from_end=True)
    return hashlib.sha256(b"ftsig" + le64(len(head)) + head + le64(len(tail)) + tail).hexdigest()


# ---- model fingerprint --------------------------------------------------------------------------
def model_fingerprint(
    *,
    pool: BlockPool,
    source: Path | None,
    spec: ModelSpec,
    model: torch.nn.Module,
    experts: ExpertStore,
    tokenizer: Any | None,
) -> str:
    """sha256 hex identifying what produced a KV cache, so anchors never cross models.

    Covers, in order: `FORMAT_VERSION`; the KV layout (dtype, block size, every layer's stream
    names and per-token shapes); every byte of the weights; config.json; the tokenizer. Weights:
    an FTW source file is hashed whole (config and tokenizer are inside it), through the engine's
    own open file when its expert store holds one (so it is the file the engine reads, even if the path was
    replaced meanwhile); an HF folder's `*.safetensors` files are each hashed whole, with their
    names; an HF folder tiered through the conversion cache also hashes the FTW file actually
    served (so a rebuilt or stale entry changes it). `weights.weights_digest` hashes each file
    version once (cached by path, device, inode, size, mtime and ctime; large files also across
    processes). An engine built in memory
    without a source hashes its spec and every byte of its dense tensors and of every expert
    its provider lists. Tokenizer: the bytes of the tokenizer files in the source folder, or the
    in-memory tokenizer's sorted vocabulary. The device is not covered: KV data means the same
    on any device.

    The engine calls this once, when it is built (`Engine.model_fingerprint`): replacing the
    weights file later never changes an engine's fingerprint. CheckpointError when a weights file
    cannot be read or changes while it is hashed.
    """
    h = hashlib.sha256(b"freetoken-model-fingerprint\0" + le64(FORMAT_VERSION))
    layout = {
        "dtype": str(pool.dtype),
        "block_size": pool.block_size,
        "streams": [[[s.name, list(s.shape)] for s in streams] for streams in pool.layer_streams],
    }
    _section(h, "kv-layout", json.dumps(layout, sort_keys=True).encode())
    source = Path(source) if source is not None else None
    folder = source if source is not None and source.is_dir() else None
    files = sorted(folder.glob("*.safetensors")) if folder is not None else []
    if source is not None and source.is_file():  # one weights file (FTW), config and tokenizer inside
        _section(h, "weights-file", bytes.fromhex(weights_digest(source, _open_fd(experts, source))))
    elif files:
        for path in files:
            _section(h, f"weights:{path.name}", bytes.fromhex(weights_digest(path)))
    else:
        _hash_in_memory_weights(h, spec, model, experts)
    served = _served_ftw(experts, source)
    if served is not None:  # an HF folder tiered through the conversion cache: the experts it serves
        _section(h, "served-ftw", bytes.fromhex(weights_digest(served, _open_fd(experts, served))))
    if folder is not None and (folder / "config.json").is_file():
        _section(h, "config.json", (folder / "config.json").read_bytes())
    tokenizer_files = [folder / f for f in TOKENIZER_FILES if (folder / f).is_file()] if folder else []
    for path in tokenizer_files:
        _section(h, path.name, path.read_bytes())
    if not tokenizer_files and tokenizer is not None:
        vocab = sorted(tokenizer.get_vocab().items())
        _section(h, "tokenizer-vocab", json.dumps(vocab).encode())
    return h.hexdigest()


def _section(h: Any, name: str, data: bytes) -> None:
    tag = name.encode()
    h.update(le64(len(tag)) + tag + le64(len(data)))
    h.update(data)


def _served_ftw(experts: ExpertStore, source: Path | None) -> Path | None:
    """The FTW file the expert store reads from, when it is not the source itself (a cached
    conversion): a rebuilt cache entry then changes the fingerprint."""
    served = experts.weights_file()
    if served is not None and (source is None or served[0] != source):
        return served[0]
    return None


def _open_fd(experts: ExpertStore, source: Path) -> int | None:
    """The descriptor of the store's own open FTW file for `source`, if it holds one."""
    served = experts.weights_file()
    if served is not None and served[1] >= 0 and served[0] == source:
        return served[1]
    return None


def _tensor_section(h: Any, name: str, tensor: torch.Tensor) -> None:
    data = tensor_bytes(tensor)
    h.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode() + le64(len(data)))
    h.update(data)


def _hash_in_memory_weights(h: Any, spec: ModelSpec, model: torch.nn.Module, experts: ExpertStore) -> None:
    _section(h, "spec", repr(spec).encode())
    for name, tensor in sorted(model.state_dict().items()):
        _tensor_section(h, name, tensor)
    for layer, expert in sorted(experts.keys()):
        _section(h, "expert", json.dumps([layer, expert]).encode())
        weights = experts.get(layer, expert)
        for field in dataclasses.fields(weights):
            value = getattr(weights, field.name)
            if isinstance(value, torch.Tensor) and field.name != "storage":
                _tensor_section(h, field.name, value)
