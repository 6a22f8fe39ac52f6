"""Saving anchors to a folder and loading them into a new engine (a new process): no pickle.

Folder layout (format version `FORMAT_VERSION`):

- `kv-<sha256>.safetensors` (`kv.safetensors` in folders saved before saves were atomic as a
  whole): one tensor per layer and stream, `layer{L}.{stream}` of shape
  `[n_blocks, block_size, *per_token_shape]` in the KV dtype: every block any saved anchor holds,
  once (anchors that share blocks in memory share them in the file and again after loading).
- `anchors.json`: `format`, `v`, `model_fingerprint`, `kv_layout`, `kv_file`, `kv_sha256` and
  `kv_bytes` of the tensor file, one record per anchor (the Anchor fields plus `blocks`, indices
  into the saved blocks, and `pinned`), and `mac`: `{"alg": "hmac-sha256", "key_id", "value"}`,
  the HMAC-SHA256 with the user's anchor key (`keys.py`) of the canonical JSON of everything
  else in the file (sorted keys, no spaces). `kv_sha256` is inside it, so the MAC covers the KV
  bytes too: a writer without the key can change neither, whatever unkeyed hashes it recomputes.

How a save replaces the previous one atomically as a whole (a crash at any point leaves one of
the two, complete), with private modes (0700 folder, 0600 files), and raises AnchorSaveError on a
full disk: `savefolder.py`. Anything else in the folder (leftovers of an interrupted save) is
never read.

Loading checks, in order: `anchors.json` is a regular file of at most `MAX_META_BYTES`
(`savefolder.read_regular`: no symbolic link, FIFO or device), the JSON parses, has this format
and version, and the shape of `AnchorsFile` (AnchorFileError); the MAC verifies with this user's
key (AnchorFileError: saved with another key, or changed since); the model fingerprint equals the
engine's (AnchorFingerprintError); the tensor file is a regular file of the recorded size (never
read past it) and sha256 (AnchorFileError: truncated, grown or corrupted) and the expected
tensors; then every anchor is fully revalidated: its blocks are rehashed into the chain, and the
kv digest, the signature, the token-prefix hash and the id must all match the record
(AnchorValidationError). Any failure releases every block it took: nothing is half-loaded.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ..errors import AnchorFileError, AnchorFingerprintError
from ..model.kv import BlockTable
from .anchor import Anchor, AnchorKind, AnchorSignature, verify_anchor
from .digest import FORMAT_VERSION, kv_digest
from .keys import key_path, load_key
from .savefolder import (
    KV_NAME_PATTERN,
    META_FILE,
    commit,
    kv_file_name,
    read_manifest,
    read_regular,
    reading,
)

if TYPE_CHECKING:
    from .host import AnchorHost

FORMAT_NAME = "freetoken-anchors"
MAC_ALG = "hmac-sha256"

Hex64 = Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[StrictInt, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SignatureRecord(_Strict):
    """An anchor's signature as saved (see `AnchorSignature`)."""

    edges: Hex64  # sha256 of the first/last `span` KV bytes
    token_hash: Hex64  # sha256 of the token ids
    span: Count  # bytes taken from each end


class AnchorRecord(_Strict):
    """One saved anchor: the `Anchor` fields (the same meaning) plus where its blocks are."""

    v: StrictInt  # record format version (FORMAT_VERSION)
    id: Hex64
    kind: AnchorKind
    label: StrictStr | None
    position: Count
    kv_length: Count
    parent_id: Hex64 | None
    created: float  # seconds since the epoch
    session_id: StrictStr
    token_ids: list[Count]
    expert_state: list[tuple[StrictStr, list[tuple[Count, Count]]]]
    kv_digest: Hex64
    signature: SignatureRecord
    blocks: list[Count]  # indices into the saved blocks, one per covered block, in order
    pinned: StrictBool  # exempt from eviction


class MacRecord(_Strict):
    """The file's authentication: HMAC-SHA256 over the canonical JSON of the rest of the file."""

    alg: Literal["hmac-sha256"]
    key_id: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{16}$")]  # tells "another key" from "changed"
    value: Hex64


class AnchorsFile(_Strict):
    """`anchors.json` (see the module docstring)."""

    format: Literal["freetoken-anchors"]
    v: StrictInt  # FORMAT_VERSION
    model_fingerprint: Hex64
    kv_layout: dict[str, Any]  # KV dtype, block size, streams (the fingerprint covers it too)
    kv_file: Annotated[StrictStr, Field(pattern=KV_NAME_PATTERN)]  # a name in the folder, no path
    kv_sha256: Hex64
    kv_bytes: Count
    n_blocks: Count
    anchors: list[AnchorRecord]
    mac: MacRecord


def _layout(host: AnchorHost) -> dict[str, Any]:
    pool = host.pool
    return {
        "dtype": str(pool.dtype),
        "block_size": pool.block_size,
        "streams": [[[s.name, list(s.shape)] for s in streams] for streams in pool.layer_streams],
    }


def save_anchors(
    host: AnchorHost,
    anchors: Sequence[Anchor],
    folder: Path,
    *,
    pinned: Collection[str],
    key_file: str | os.PathLike[str] | None = None,
) -> Path:
    """Write `anchors` to `folder` (created 0700 if needed; the previous save there replaced
    atomically as a whole, see `savefolder.py`), authenticated with the anchor key at `key_file`
    (default: `keys.key_path()`; created if missing). Returns folder.

    Raises AnchorSaveError when the folder cannot be written (full disk, quota, permissions): what
    this call wrote is removed and the previous save is unchanged."""
    pool = host.pool
    index: dict[int, int] = {}
    for anchor in anchors:
        for b in anchor.table.blocks:
            index.setdefault(b, len(index))
    order = torch.tensor(list(index), dtype=torch.long, device=pool.device)
    tensors = {
        f"layer{layer}.{name}": storage.index_select(0, order).cpu().contiguous()
        for layer, layer_storage in enumerate(pool.storage)
        for name, storage in layer_storage.items()
    }
    data = save_safetensors(tensors, metadata={"format": FORMAT_NAME, "v": str(FORMAT_VERSION)})
    kv_sha256 = hashlib.sha256(data).hexdigest()
    kv_name = kv_file_name(kv_sha256)
    records = [
        {
            "v": a.v,
            "id": a.id,
            "kind": a.kind,
            "label": a.label,
            "position": a.position,
            "kv_length": a.kv_length,
            "parent_id": a.parent_id,
            "created": a.created,
            "session_id": a.session_id,
            "token_ids": list(a.token_ids),
            "expert_state": [[tier, [list(k) for k in keys]] for tier, keys in a.expert_state],
            "kv_digest": a.kv_digest,
            "signature": {
                "edges": a.signature.edges,
                "token_hash": a.signature.token_hash,
                "span": a.signature.span,
            },
            "blocks": [index[b] for b in a.table.blocks],
            "pinned": a.id in pinned,
        }
        for a in anchors
    ]
    meta: dict[str, Any] = {
        "format": FORMAT_NAME,
        "v": FORMAT_VERSION,
        "model_fingerprint": host.model_fingerprint,
        "kv_layout": _layout(host),
        "kv_file": kv_name,
        "kv_sha256": kv_sha256,
        "kv_bytes": len(data),
        "n_blocks": len(index),
        "anchors": records,
    }
    key = load_key(key_file, create=True)
    meta["mac"] = {"alg": MAC_ALG, "key_id": _key_id(key), "value": _mac(key, meta)}
    commit(folder, kv_name, data, (json.dumps(meta, indent=1) + "\n").encode())
    return folder


def load_anchors(
    host: AnchorHost, folder: Path, *, key_file: str | os.PathLike[str] | None = None
) -> tuple[list[Anchor], set[str]]:
    """Read, authenticate (with the anchor key at `key_file`, default `keys.key_path()`) and fully
    validate the anchors in `folder` (see the module docstring).

    Returns (anchors, ids saved as pinned); each anchor holds its own pin of freshly
    allocated blocks of `host.pool`.
    """
    meta_path = folder / META_FILE
    with reading(folder):  # a concurrent save may not remove the KV file this manifest names
        raw, meta = _read_meta(meta_path)
        _authenticate(raw, meta_path, key_file)
        if meta.model_fingerprint != host.model_fingerprint:
            raise AnchorFingerprintError(
                f"{meta_path} holds anchors of model {meta.model_fingerprint[:16]}..., but this engine is "
                f"{host.model_fingerprint[:16]}... (another model, tokenizer, KV layout or format version)"
            )
        tensors = _read_kv(folder / meta.kv_file, meta, host)
    pool = host.pool
    loader: list[int] = []  # the loader's own reference to every block it allocates
    anchors: list[Anchor] = []
    try:
        for _ in range(meta.n_blocks):
            loader.append(pool.allocate())
        if loader:
            dst = torch.tensor(loader, dtype=torch.long, device=pool.device)
            # Pool storage grown during a forward step is an inference tensor: write it in that mode.
            with torch.inference_mode():
                for layer, layer_storage in enumerate(pool.storage):
                    for name, storage in layer_storage.items():
                        storage.index_copy_(0, dst, tensors[f"layer{layer}.{name}"].to(pool.device))
        for b in loader:
            pool.filled[b] = pool.block_size  # unknown writers: the first write copies
        for record in meta.anchors:
            anchors.append(_restore(record, loader, host, meta_path))
    except BaseException:
        for anchor in anchors:
            anchor.table.release()
        pool.decref(loader)
        raise
    pool.decref(loader)
    pinned = {r.id for r in meta.anchors if r.pinned}
    return anchors, pinned


def _restore(record: AnchorRecord, loader: list[int], host: AnchorHost, where: Path) -> Anchor:
    bs = host.pool.block_size
    if record.v != FORMAT_VERSION or any(i >= len(loader) for i in record.blocks):
        raise AnchorFileError(f"{where}: malformed anchor record {record.id[:16]}: version or block index")
    if len(record.blocks) != -(-record.kv_length // bs) or record.kv_length > record.position:
        raise AnchorFileError(
            f"{where}: malformed anchor record {record.id[:16]}: {len(record.blocks)} blocks cannot hold "
            f"{record.kv_length} of its {record.position} positions"
        )
    if len(record.token_ids) != record.position:
        raise AnchorFileError(
            f"{where}: anchor record {record.id[:16]} has {len(record.token_ids)} token ids"
        )
    # Borrows the loader's references; pin() takes the anchor's own.
    view = BlockTable(host.pool, [loader[i] for i in record.blocks], record.kv_length)
    kv_digest(view)  # seal: rehash every full block of the loaded data into the chain
    sig = record.signature
    anchor = Anchor(
        id=record.id,
        kind=record.kind,
        label=record.label,
        position=record.position,
        kv_length=record.kv_length,
        parent_id=record.parent_id,
        created=float(record.created),
        session_id=record.session_id,
        token_ids=tuple(record.token_ids),
        expert_state=tuple(
            (tier, tuple((int(k[0]), int(k[1])) for k in keys)) for tier, keys in record.expert_state
        ),
        kv_digest=record.kv_digest,
        model_fingerprint=host.model_fingerprint,
        signature=AnchorSignature(edges=sig.edges, token_hash=sig.token_hash, span=sig.span),
        table=view.pin(),
    )
    try:
        verify_anchor(anchor, anchor.table, host.model_fingerprint, "full")
    except BaseException:
        anchor.table.release()
        raise
    return anchor


def _canonical(meta: dict[str, Any]) -> bytes:
    body = {k: v for k, v in meta.items() if k != "mac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _mac(key: bytes, meta: dict[str, Any]) -> str:
    return hmac.new(key, b"freetoken-anchors-mac\0" + _canonical(meta), hashlib.sha256).hexdigest()


def _key_id(key: bytes) -> str:
    return hashlib.sha256(b"freetoken-anchor-key-id\0" + key).hexdigest()[:16]


def _authenticate(meta: dict[str, Any], where: Path, key_file: str | os.PathLike[str] | None) -> None:
    """AnchorFileError unless `meta` carries a valid HMAC made with this user's anchor key."""
    mac = meta.get("mac")
    if not isinstance(mac, dict) or mac.get("alg") != MAC_ALG or not isinstance(mac.get("value"), str):
        raise AnchorFileError(f"{where} carries no {MAC_ALG} authentication: it cannot be trusted")
    key = load_key(key_file, create=False)
    if hmac.compare_digest(_mac(key, meta), mac["value"]):
        return
    if mac.get("key_id") != _key_id(key):
        raise AnchorFileError(
            f"{where} was saved with another anchor key than {key_path(key_file)} (another user or key "
            f"file): refused"
        )
    raise AnchorFileError(f"{where} was changed after it was saved (its HMAC does not verify): refused")


def _read_meta(path: Path) -> tuple[dict[str, Any], AnchorsFile]:
    """(the parsed JSON, the same as an AnchorsFile): AnchorFileError unless it has this format,
    this version and the shape of AnchorsFile."""
    try:
        meta = json.loads(read_manifest(path))
    except FileNotFoundError as e:
        raise AnchorFileError(f"{path} does not exist: not a saved anchor folder") from e
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise AnchorFileError(f"cannot read {path} (truncated or corrupted?): {e!r}"[:300]) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise AnchorFileError(f"{path} is not a {FORMAT_NAME} file")
    if meta.get("v") != FORMAT_VERSION:
        raise AnchorFileError(
            f"{path} has anchor format version {meta.get('v')}, this engine reads {FORMAT_VERSION}"
        )
    try:
        return meta, AnchorsFile.model_validate(meta)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the file"
        raise AnchorFileError(f"{path} is malformed at {where}: {first['msg']}") from None


def _read_kv(path: Path, meta: AnchorsFile, host: AnchorHost) -> dict[str, torch.Tensor]:
    try:  # the manifest is authenticated by now: its size bounds the read
        data = read_regular(path, meta.kv_bytes, "the size its authenticated manifest records")
    except FileNotFoundError as e:
        raise AnchorFileError(f"{path}, named by its manifest, does not exist") from e
    if len(data) != meta.kv_bytes or hashlib.sha256(data).hexdigest() != meta.kv_sha256:
        raise AnchorFileError(
            f"{path} is truncated or corrupted: {len(data)} bytes, expected {meta.kv_bytes} with sha256 "
            f"{meta.kv_sha256[:16]}..."
        )
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError) as e:
        raise AnchorFileError(f"cannot parse {path}: {e}") from e
    pool, n = host.pool, meta.n_blocks
    for layer, streams in enumerate(pool.layer_streams):
        for spec in streams:
            name = f"layer{layer}.{spec.name}"
            t = tensors.get(name)
            expected = (n, pool.block_size, *spec.shape)
            if t is None or tuple(t.shape) != expected or t.dtype != pool.dtype:
                got = "missing" if t is None else f"{list(t.shape)} {t.dtype}"
                raise AnchorFileError(
                    f"{path}: tensor {name} is {got}, expected {list(expected)} {pool.dtype}"
                )
    return tensors
