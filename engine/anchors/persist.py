"""Saving anchors to a folder and loading them into a new engine (a new process): no pickle.

Folder layout (format version `FORMAT_VERSION`):

- `kv.safetensors`: one tensor per layer and stream, `layer{L}.{stream}` of shape
  `[n_blocks, block_size, *per_token_shape]` in the KV dtype: every block any saved anchor holds,
  once (anchors that share blocks in memory share them in the file and again after loading).
- `anchors.json`: `format`, `v`, `model_fingerprint`, `kv_layout`, `kv_file`, `kv_sha256` and
  `kv_bytes` of the tensor file, and one record per anchor: the Anchor fields plus `blocks`
  (indices into the saved blocks) and `pinned`.

Loading checks, in order: the JSON parses and has this format and version (AnchorFileError); the
model fingerprint equals the engine's (AnchorFingerprintError); the tensor file has the recorded
size and sha256 (AnchorFileError: truncated or corrupted) and the expected tensors; then every
anchor is fully revalidated: its blocks are rehashed into the chain, and the kv digest, the
signature, the token-prefix hash and the id must all match the record (AnchorValidationError).
Any failure releases every block it took: nothing is half-loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ..errors import AnchorFileError, AnchorFingerprintError
from ..kv import BlockTable
from .anchor import Anchor, AnchorSignature, check_kind, verify_anchor
from .digest import FORMAT_VERSION, kv_digest

if TYPE_CHECKING:
    from ..engine import Engine

FORMAT_NAME = "freetoken-anchors"
META_FILE = "anchors.json"
KV_FILE = "kv.safetensors"


def _layout(engine: Engine) -> dict[str, Any]:
    pool = engine.kv_pool
    return {
        "dtype": str(pool.dtype),
        "block_size": pool.block_size,
        "streams": [[[s.name, list(s.shape)] for s in streams] for streams in pool.layer_streams],
    }


def save_anchors(engine: Engine, anchors: Sequence[Anchor], folder: Path, *, pinned: Collection[str]) -> Path:
    """Write `anchors` to `folder` (created if needed; files replaced atomically). Returns folder."""
    pool = engine.kv_pool
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
    meta = {
        "format": FORMAT_NAME,
        "v": FORMAT_VERSION,
        "model_fingerprint": engine.model_fingerprint,
        "kv_layout": _layout(engine),
        "kv_file": KV_FILE,
        "kv_sha256": hashlib.sha256(data).hexdigest(),
        "kv_bytes": len(data),
        "n_blocks": len(index),
        "anchors": records,
    }
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / KV_FILE, data)
    _write_atomic(folder / META_FILE, (json.dumps(meta, indent=1) + "\n").encode())
    return folder


def load_anchors(engine: Engine, folder: Path) -> tuple[list[Anchor], set[str]]:
    """Read and fully validate the anchors in `folder` (see the module docstring).

    Returns (anchors, ids saved as pinned); each anchor holds its own pin of freshly
    allocated blocks of `engine.kv_pool`.
    """
    meta_path, kv_path = folder / META_FILE, folder / KV_FILE
    meta = _read_meta(meta_path)
    if meta["model_fingerprint"] != engine.model_fingerprint:
        raise AnchorFingerprintError(
            f"{meta_path} holds anchors of model {str(meta['model_fingerprint'])[:16]}..., but this engine "
            f"is {engine.model_fingerprint[:16]}... (another model, tokenizer, KV layout or format version)"
        )
    tensors = _read_kv(kv_path, meta, engine)
    pool = engine.kv_pool
    loader: list[int] = []  # the loader's own reference to every block it allocates
    anchors: list[Anchor] = []
    try:
        for _ in range(int(meta["n_blocks"])):
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
        for record in meta["anchors"]:
            anchors.append(_restore(record, loader, engine, meta_path))
    except BaseException:
        for anchor in anchors:
            anchor.table.release()
        pool.decref(loader)
        raise
    pool.decref(loader)
    pinned = {r["id"] for r in meta["anchors"] if r.get("pinned")}
    return anchors, pinned


def _restore(record: dict[str, Any], loader: list[int], engine: Engine, where: Path) -> Anchor:
    try:
        blocks = [loader[i] for i in record["blocks"]]
        kv_length = int(record["kv_length"])
        token_ids = tuple(int(t) for t in record["token_ids"])
        state = tuple(
            (str(tier), tuple((int(k[0]), int(k[1])) for k in keys)) for tier, keys in record["expert_state"]
        )
        sig = record["signature"]
        signature = AnchorSignature(
            edges=str(sig["edges"]), token_hash=str(sig["token_hash"]), span=int(sig["span"])
        )
        if len(blocks) != -(-kv_length // engine.kv_pool.block_size):
            raise ValueError(f"{len(blocks)} blocks cannot hold {kv_length} positions")
        # Borrows the loader's references; pin() takes the anchor's own.
        view = BlockTable(engine.kv_pool, blocks, kv_length)
        kv_digest(view)  # seal: rehash every full block of the loaded data into the chain
        anchor = Anchor(
            id=str(record["id"]),
            kind=check_kind(str(record["kind"])),
            label=record["label"],
            position=int(record["position"]),
            kv_length=kv_length,
            parent_id=record["parent_id"],
            created=float(record["created"]),
            session_id=str(record["session_id"]),
            token_ids=token_ids,
            expert_state=state,
            kv_digest=str(record["kv_digest"]),
            model_fingerprint=engine.model_fingerprint,
            signature=signature,
            table=view.pin(),
        )
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise AnchorFileError(f"{where}: malformed anchor record {str(record.get('id'))[:16]}: {e}") from e
    try:
        verify_anchor(anchor, anchor.table, engine.model_fingerprint, "full")
    except BaseException:
        anchor.table.release()
        raise
    return anchor


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise AnchorFileError(f"{path} does not exist: not a saved anchor folder") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AnchorFileError(f"cannot read {path} (truncated or corrupted?): {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise AnchorFileError(f"{path} is not a {FORMAT_NAME} file")
    if meta.get("v") != FORMAT_VERSION:
        raise AnchorFileError(
            f"{path} has anchor format version {meta.get('v')}, this engine reads {FORMAT_VERSION}"
        )
    required = ("model_fingerprint", "kv_sha256", "kv_bytes", "n_blocks", "anchors")
    missing = [k for k in required if k not in meta]
    if missing:
        raise AnchorFileError(f"{path} lacks {', '.join(missing)}")
    return meta


def _read_kv(path: Path, meta: dict[str, Any], engine: Engine) -> dict[str, torch.Tensor]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise AnchorFileError(f"cannot read {path}: {e}") from e
    if len(data) != meta["kv_bytes"] or hashlib.sha256(data).hexdigest() != meta["kv_sha256"]:
        raise AnchorFileError(
            f"{path} is truncated or corrupted: {len(data)} bytes, expected {meta['kv_bytes']} with sha256 "
            f"{str(meta['kv_sha256'])[:16]}..."
        )
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError) as e:
        raise AnchorFileError(f"cannot parse {path}: {e}") from e
    pool, n = engine.kv_pool, int(meta["n_blocks"])
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


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
