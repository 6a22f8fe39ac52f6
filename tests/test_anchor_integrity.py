"""Anchor integrity (issue 23): the default rollback validation catches every corruption of the KV
an anchor covers, saved anchors cannot be forged without the user's key, malformed files raise
AnchorFileError, and the model fingerprint covers every byte of the weights, taken at load."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny_model

from freetoken_agents.engine import (
    AnchorError,
    AnchorFileError,
    AnchorFingerprintError,
    AnchorValidationError,
    Engine,
)
from freetoken_agents.engine.anchors import DEFAULT_VALIDATION, VALIDATIONS, AnchorStore, key_path
from freetoken_agents.engine.anchors.anchor import verify_anchor
from freetoken_agents.engine.anchors.digest import rehash_kv
from freetoken_agents.engine.anchors.persist import _key_id, _mac
from freetoken_agents.engine.loading import fingerprint as weights_module
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.runtime.session import Session

pytestmark = pytest.mark.usefixtures("one_thread", "anchor_key")


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint("qwen3_moe"))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 480, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _closed_anchor(engine: Engine, ids: list[int], kind: str = "manual"):
    with engine.new_session() as s:
        s.prefill(ids)
        return s.anchor(kind)


# ---- validation ---------------------------------------------------------------------------------
def _single_element_corruptions(engine: Engine, anchor, n: int, seed: int):
    """(layer, stream, slot, element) of `n` random single values of the KV under `anchor`."""
    g = torch.Generator().manual_seed(seed)
    streams = [(layer, spec) for layer, specs in enumerate(engine.kv_pool.layer_streams) for spec in specs]
    for _ in range(n):
        layer, spec = streams[int(torch.randint(len(streams), (1,), generator=g))]
        position = int(torch.randint(anchor.kv_length, (1,), generator=g))
        element = int(torch.randint(int(torch.Size(spec.shape).numel()), (1,), generator=g))
        yield layer, spec.name, int(anchor.table.slots[position]), element


def _state(session) -> tuple:
    return session.token_ids, list(session.table.blocks), session.engine.kv_pool.blocks_in_use


def test_default_validation_catches_every_single_element_kv_corruption(engine):
    assert DEFAULT_VALIDATION == "blocks" and set(VALIDATIONS) == {"blocks", "signature", "full"}
    default = inspect.signature(Session.rollback).parameters["validate"].default
    assert default in (None, DEFAULT_VALIDATION), (
        f"engine/runtime/session.py: Session.rollback's validate defaults to {default!r}; it "
        f"must be None (the engine's default, {DEFAULT_VALIDATION!r}) so that a plain rollback "
        "rehashes the anchor's KV"
    )
    anchor = _closed_anchor(engine, _ids(102, 40))
    signature_caught = 0
    with engine.new_session() as s, torch.inference_mode():
        s.prefill(_ids(9, 41))
        for layer, stream, slot, element in _single_element_corruptions(engine, anchor, 200, seed=42):
            row = engine.kv_pool.flat(layer, stream)[slot].reshape(-1)
            original = row[element].clone()
            row[element] += 0.5
            before = _state(s)
            with pytest.raises(AnchorValidationError, match="KV data differs from its digest"):
                s.rollback(anchor)  # the default
            assert _state(s) == before
            try:
                s.rollback(anchor, validate="signature")
            except AnchorValidationError:
                signature_caught += 1
            row[element] = original
        s.rollback(anchor)  # intact again
    assert signature_caught < 200  # the opt-in signature sees only the first/last 512 bytes


def test_validate_values(engine):
    anchor = _closed_anchor(engine, _ids(35, 43))
    with engine.new_session() as s:
        for mode in (None, *VALIDATIONS):
            s.rollback(anchor, validate=mode)
        with pytest.raises(
            AnchorError, match="validate must be one of 'blocks', 'signature', 'full' or None"
        ):
            s.rollback(anchor, validate="fast")
    view = anchor.table.fork()
    try:
        verify_anchor(anchor, view, engine.model_fingerprint)  # None: the default
        # The path a GPU pool takes (blocks gathered to the host first) hashes the same bytes.
        assert rehash_kv(view, gather=True) == rehash_kv(view, gather=False) == (anchor.kv_digest, None)
        with torch.inference_mode():
            engine.kv_pool.flat(0, engine.kv_pool.layer_streams[0][0].name)[int(anchor.table.slots[17])] += 1
        with pytest.raises(AnchorValidationError, match=r"block 1 \(positions 16\.\.31\)"):
            verify_anchor(anchor, view, engine.model_fingerprint)
    finally:
        view.release()


# ---- authenticated save files -------------------------------------------------------------------
def _save(engine: Engine, folder: Path, ids: list[int]):
    engine.anchors.clear()
    with engine.new_session() as s:
        s.prefill(ids)
        anchor = s.anchor("tool_call")
    engine.anchors.save(folder)
    engine.anchors.clear()
    return anchor


def test_save_creates_a_private_key_and_loads_back(engine, tmp_path, anchor_key):
    anchor = _save(engine, tmp_path / "a", _ids(40, 44))
    assert stat.S_IMODE(anchor_key.stat().st_mode) == 0o600
    assert stat.S_IMODE(anchor_key.parent.stat().st_mode) == 0o700
    assert [a.id for a in engine.anchors.load(tmp_path / "a")] == [anchor.id]


def test_a_resealed_forgery_is_refused(engine, tmp_path, anchor_key):
    """The attacker has no key: it makes the folder it wants with the real code (every unkeyed hash
    consistent) under a key of its own, then either ships it as is or puts the victim's MAC on it."""
    victim = tmp_path / "victim"
    _save(engine, victim, _ids(40, 45))
    genuine_mac = json.loads((victim / "anchors.json").read_text())["mac"]
    forged = tmp_path / "forged"
    os.environ["FREETOKEN_ANCHOR_KEY_FILE"] = str(tmp_path / "attacker.key")
    _save(engine, forged, [*_ids(39, 45), 7])  # other token ids, KV, digests, ids: all consistent
    os.environ["FREETOKEN_ANCHOR_KEY_FILE"] = str(anchor_key)
    with pytest.raises(AnchorFileError, match="saved with another anchor key"):
        engine.anchors.load(forged)
    doc = json.loads((forged / "anchors.json").read_text())
    doc["mac"] = genuine_mac
    (forged / "anchors.json").write_text(json.dumps(doc))
    with pytest.raises(AnchorFileError, match="changed after it was saved"):
        engine.anchors.load(forged)
    del doc["mac"]
    (forged / "anchors.json").write_text(json.dumps(doc))
    with pytest.raises(AnchorFileError, match="malformed at mac"):
        engine.anchors.load(forged)
    doc = json.loads((victim / "anchors.json").read_text())
    doc["anchors"][0]["expert_state"] = [["fast", [[0, 1]]]]  # a forged expert state
    (victim / "anchors.json").write_text(json.dumps(doc))
    with pytest.raises(AnchorFileError, match="changed after it was saved"):
        engine.anchors.load(victim)
    assert len(engine.anchors) == 0 and engine.kv_pool.blocks_in_use == 0


def _resealed(doc: dict, key_file: Path) -> str:
    key = bytes.fromhex(key_file.read_text().strip())
    doc = {k: v for k, v in doc.items() if k != "mac"}
    doc["mac"] = {"alg": "hmac-sha256", "key_id": _key_id(key), "value": _mac(key, doc)}
    return json.dumps(doc)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(anchors=None),
        lambda d: d.update(anchors=[7]),
        lambda d: d["anchors"][0].update(token_ids="abc"),
        lambda d: d["anchors"][0].update(blocks=[-1, 0, 1]),
        lambda d: d["anchors"][0].update(blocks=[99, 0, 1]),
        lambda d: d["anchors"][0].update(kind="bogus"),
        lambda d: d["anchors"][0].pop("signature"),
        lambda d: d.update(n_blocks=-1),
        lambda d: d.update(kv_bytes="12"),
        lambda d: d.update(extra=1),
    ],
)
def test_malformed_files_raise_anchor_file_error(engine, tmp_path, anchor_key, mutate):
    folder = tmp_path / "a"
    _save(engine, folder, _ids(40, 46))
    doc = json.loads((folder / "anchors.json").read_text())
    mutate(doc)
    for text in (json.dumps(doc), _resealed(doc, anchor_key)):  # unsigned, and signed with our key
        (folder / "anchors.json").write_text(text)
        with pytest.raises(AnchorFileError):
            engine.anchors.load(folder)
    assert len(engine.anchors) == 0 and engine.kv_pool.blocks_in_use == 0


def test_key_location_and_refusals(engine, tmp_path, monkeypatch):
    monkeypatch.delenv("FREETOKEN_ANCHOR_KEY_FILE")
    monkeypatch.delenv("FREETOKEN_CONFIG_DIR", raising=False)  # conftest points it at a temp dir
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert key_path() == tmp_path / "xdg" / "freetoken" / "anchor.key"  # the user's config dir
    monkeypatch.setenv("FREETOKEN_CONFIG_DIR", str(tmp_path / "cfg"))
    assert key_path() == tmp_path / "cfg" / "anchor.key"
    monkeypatch.setenv("FREETOKEN_ANCHOR_KEY_FILE", str(tmp_path / "env.key"))
    assert key_path() == tmp_path / "env.key"
    store = AnchorStore(engine.anchors.host, key_file=tmp_path / "own.key")  # the constructor argument wins
    with engine.new_session() as s:
        s.prefill(_ids(20, 47))
        anchor = store.create(s.table, s.token_ids, kind="manual")
    store.save(tmp_path / "a")
    assert (tmp_path / "own.key").exists() and not (tmp_path / "env.key").exists()
    store.clear()
    assert [a.id for a in store.load(tmp_path / "a")] == [anchor.id]
    store.clear()
    (tmp_path / "own.key").chmod(0o644)
    with pytest.raises(AnchorError, match="chmod 600"):
        store.load(tmp_path / "a")
    with pytest.raises(AnchorFileError, match="no anchor key"):
        AnchorStore(engine.anchors.host, key_file=tmp_path / "missing.key").load(tmp_path / "a")
    assert engine.kv_pool.blocks_in_use == 0


# ---- the model fingerprint ----------------------------------------------------------------------
def test_a_swapped_model_files_anchors_are_refused(tiny_checkpoint, tmp_path):
    path = tmp_path / "model.ftw"
    convert_checkpoint(tiny_checkpoint("qwen3_moe"), path, quant="fp32", progress=False)
    other = build_tiny_model("qwen3_moe", tmp_path / "other", seed=1)
    running = Engine.from_pretrained(path)
    fingerprint = running.model_fingerprint
    convert_checkpoint(other, tmp_path / "other.ftw", quant="fp32", progress=False)
    os.replace(tmp_path / "other.ftw", path)  # the file is swapped under the running engine
    swapped = Engine.from_pretrained(path)
    assert running.model_fingerprint == fingerprint != swapped.model_fingerprint
    with swapped.new_session() as s:
        s.prefill(_ids(30, 48))
        foreign = s.anchor("manual")
    swapped.anchors.save(tmp_path / "anchors")
    with pytest.raises(AnchorFingerprintError, match="another model"):
        running.anchors.load(tmp_path / "anchors")
    with running.new_session() as s, pytest.raises(AnchorFingerprintError):
        s.rollback(foreign)
    running.close()
    swapped.close()


def test_the_fingerprint_covers_every_byte_of_the_weights(tmp_path, monkeypatch):
    folder = build_tiny_model("qwen3_moe", tmp_path / "m", moe_intermediate_size=256)
    weights = folder / "model.safetensors"
    assert weights.stat().st_size > 2 << 20  # larger than what used to be hashed whole
    copy = tmp_path / "changed"
    shutil.copytree(folder, copy)
    with (copy / "model.safetensors").open("r+b") as f:  # one low mantissa bit, between samples
        header = 8 + int.from_bytes(f.read(8), "little")
        data = weights.stat().st_size - header
        offset = header + (data - 4096) // 63 // 2 // 4 * 4
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    assert Engine.from_pretrained(folder).model_fingerprint != Engine.from_pretrained(copy).model_fingerprint

    calls = []
    real = weights_module._hash_fd
    monkeypatch.setattr(weights_module, "_hash_fd", lambda *a: calls.append(a[1]) or real(*a))
    weights_module.clear_memory_cache()
    first = weights_module.weights_digest(weights)
    assert weights_module.weights_digest(weights) == first and len(calls) == 1  # hashed once
    os.utime(weights)  # a new mtime (and ctime): hashed again
    assert weights_module.weights_digest(weights) == first and len(calls) == 2
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weights_module, "PERSIST_MIN_BYTES", 1)
    weights_module.clear_memory_cache()
    assert weights_module.weights_digest(weights) == first and len(calls) == 3
    weights_module.clear_memory_cache()  # a new process: the persisted digest is used
    assert weights_module.weights_digest(weights) == first and len(calls) == 3
    assert (tmp_path / "cache" / "ftw" / "fingerprints.json").exists()
