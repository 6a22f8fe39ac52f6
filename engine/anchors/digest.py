"""The digests behind anchor identity and validation, and the model fingerprint.

Everything here is deterministic and versioned by `FORMAT_VERSION`, which is hashed into the model
fingerprint and into every anchor id (so a format change can never alias an old anchor).

- `token_bytes`: token ids as fixed-width little-endian int64, concatenated.
- `kv_digest(table)`: `sha256("ftkv" || chain[n_full - 1] || le64(length) || partial)`, where
  `chain` is the table's chained digest of its full blocks (computed once per block when it
  fills, see `engine.kv`) and `partial` the xxh3-128 of the filled positions of the partial last
  block (at most `block_size` tokens). Cost: O(block_size), independent of the context length.
- `rehash_kv(table)`: the same digest recomputed from the KV bytes of every block (O(context)).
- `signature_edges(table)`: sha256 of the first and the last `SIGNATURE_SPAN` bytes of the
  table's *KV byte stream*: layer 0's first stream for positions 0, 1, ... then its next stream,
  ..., up to the last layer's last stream ending at the last position; each position's vector
  in C order. Head and tail are read with one small gather per stream touched.
- `model_fingerprint(engine)`: see its docstring.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..kv import CHAIN_SEED, BlockTable, tensor_bytes

if TYPE_CHECKING:
    from ..engine import Engine

FORMAT_VERSION = 1  # engine anchor format: fingerprint, id and save-file layout
SIGNATURE_SPAN = 512  # bytes taken from each end of the KV byte stream
FULL_FILE_LIMIT = 1 << 20  # safetensors data sections up to this size are hashed whole
SAMPLE_WINDOWS = 64  # otherwise: this many evenly spaced windows (first and last included) ...
SAMPLE_BYTES = 4096  # ... of this many bytes each
OTHER_FILE_HEAD = 1 << 16  # a single weights file (FTW): header and manifest hashed whole up to this
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "chat_template.jinja",
)


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


def rehash_kv(table: BlockTable) -> tuple[str, int | None]:
    """(`kv_digest` recomputed from every block's bytes, index of the first full block whose
    recomputed chain differs from the table's stored `chain`, or None)."""
    pool, full = table.pool, table.length // table.pool.block_size
    value, first_bad = CHAIN_SEED, None
    for i in range(full):
        value = hashlib.sha256(value + pool.digest_block(table.blocks[i])).digest()
        if first_bad is None and (i >= len(table.chain) or table.chain[i] != value):
            first_bad = i
    return _finish(table, value), first_bad


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
def model_fingerprint(engine: Engine) -> str:
    """sha256 hex identifying what produced a KV cache, so anchors never cross models.

    Covers, in order: `FORMAT_VERSION`; the KV layout (dtype, block size, every layer's stream
    names and per-token shapes); the weights; config.json; the tokenizer. Weights: each
    `*.safetensors` file of `engine.source` contributes its name, size and full header (tensor
    names, dtypes, shapes, offsets) plus its data section, hashed whole up to 1 MiB and otherwise
    as 64 evenly spaced 4 KiB windows (first and last included): a few hundred KiB of reads per
    file, stable across processes, and any retrained or re-initialised model differs in the
    sampled bytes. (It is a fingerprint, not an integrity check of the weights: FTW blocks carry
    their own checksums.) An FTW source file is hashed the same way, its first 64 KiB (header
    and manifest) whole. An engine built in memory without a source hashes its spec,
    the first 4 KiB of every dense parameter and its expert keys instead. Tokenizer: the bytes of
    the tokenizer files in the source folder, or the in-memory tokenizer's sorted vocabulary.
    The device is not covered: KV data means the same on any device.
    """
    h = hashlib.sha256(b"freetoken-model-fingerprint\0" + le64(FORMAT_VERSION))
    pool = engine.kv_pool
    layout = {
        "dtype": str(pool.dtype),
        "block_size": pool.block_size,
        "streams": [[[s.name, list(s.shape)] for s in streams] for streams in pool.layer_streams],
    }
    _section(h, "kv-layout", json.dumps(layout, sort_keys=True).encode())
    source = Path(engine.source) if engine.source is not None else None
    folder = source if source is not None and source.is_dir() else None
    files = sorted(folder.glob("*.safetensors")) if folder is not None else []
    if source is not None and source.is_file():  # one weights file (FTW), config and tokenizer inside
        _hash_file(h, source, head=min(source.stat().st_size, OTHER_FILE_HEAD))
    elif files:
        for path in files:
            with path.open("rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
            _hash_file(h, path, head=8 + header_len)
    else:
        _hash_in_memory_weights(h, engine)
    if folder is not None and (folder / "config.json").is_file():
        _section(h, "config.json", (folder / "config.json").read_bytes())
    tokenizer_files = [folder / f for f in TOKENIZER_FILES if (folder / f).is_file()] if folder else []
    for path in tokenizer_files:
        _section(h, path.name, path.read_bytes())
    if not tokenizer_files and engine.has_tokenizer:
        vocab = sorted(engine.tokenizer.get_vocab().items())
        _section(h, "tokenizer-vocab", json.dumps(vocab).encode())
    return h.hexdigest()


def _section(h: hashlib._Hash, name: str, data: bytes) -> None:
    tag = name.encode()
    h.update(le64(len(tag)) + tag + le64(len(data)))
    h.update(data)


def _hash_file(h: hashlib._Hash, path: Path, *, head: int) -> None:
    """Name, size and the first `head` bytes of `path`, plus its data after them (whole up to
    FULL_FILE_LIMIT, else SAMPLE_WINDOWS evenly spaced windows of SAMPLE_BYTES)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        header = f.read(head)
        start = len(header)
        data_len = max(0, size - start)
        if data_len <= FULL_FILE_LIMIT:
            windows = [(start, data_len)]
        else:
            step = (data_len - SAMPLE_BYTES) // (SAMPLE_WINDOWS - 1)
            windows = [(start + i * step, SAMPLE_BYTES) for i in range(SAMPLE_WINDOWS)]
        samples = []
        for offset, length in windows:
            f.seek(offset)
            samples.append(f.read(length))
    _section(h, f"{path.name}:{size}", header)
    _section(h, f"{path.name}:data", b"".join(samples))


def _hash_in_memory_weights(h: hashlib._Hash, engine: Engine) -> None:
    _section(h, "spec", repr(engine.spec).encode())
    for name, tensor in sorted(engine.model.state_dict().items()):
        head = bytes(tensor_bytes(tensor.reshape(-1)[: max(1, SAMPLE_BYTES // tensor.element_size())]))
        _section(h, f"{name}:{tensor.dtype}:{list(tensor.shape)}", head)
    keys = getattr(engine.experts, "keys", None)
    if callable(keys):
        _section(h, "expert-keys", json.dumps([list(k) for k in keys()]).encode())
