"""Semantic anchors: rollback equivalence, validation, identity, budget and persistence."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import ARCHS, build_tiny_model

from freetoken_agents.engine import (
    AnchorError,
    AnchorFileError,
    AnchorFingerprintError,
    AnchorNotFoundError,
    AnchorValidationError,
    Engine,
    MemoryBudget,
    MemoryBudgetError,
)

ATOL = 1e-5


@pytest.fixture(autouse=True)
def anchor_key(tmp_path_factory, monkeypatch) -> Path:
    """Saved anchors are authenticated with a per-user key: tests use their own, never the home's."""
    path = tmp_path_factory.getbasetemp() / "anchor.key"
    monkeypatch.setenv("FREETOKEN_ANCHOR_KEY_FILE", str(path))
    return path


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 480, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def engine_for(tiny_checkpoint):
    """`engine_for(arch)` -> a cached Engine with an empty, unbounded anchor store."""
    cache: dict[str, Engine] = {}

    def get(arch: str = "qwen3_moe") -> Engine:
        if arch not in cache:
            cache[arch] = Engine.from_pretrained(tiny_checkpoint(arch))
        engine = cache[arch]
        engine.anchors.clear()
        engine.anchors.byte_budget = None
        return engine

    return get


def _fresh_logits(engine: Engine, ids: list[int], last: int) -> torch.Tensor:
    with engine.new_session() as s:
        return s.prefill(ids)[-last:]


def _decode_all(session, tokens: list[int]) -> torch.Tensor:
    return torch.stack([session.decode(t) for t in tokens])


def _state(session) -> tuple:
    pool = session.engine.kv_pool
    return (session.token_ids, session.cached_tokens, list(session.table.blocks), pool.blocks_in_use)


def _flip_byte(engine: Engine, layer: int, stream: str, slot: int, byte: int = 0) -> None:
    row = engine.kv_pool.flat(layer, stream)[slot].reshape(-1).view(torch.uint8)
    row[byte] ^= 0x10


def _closed_anchor(engine: Engine, ids: list[int], kind: str = "manual"):
    """An anchor whose blocks no session holds any more (so corrupting them touches nothing else)."""
    with engine.new_session() as s:
        s.prefill(ids)
        return s.anchor(kind)


# ---- equivalence ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_then_decode_equals_fresh_prefill(arch, engine_for):
    engine = engine_for(arch)
    ids, detour, cont = _ids(37, 1), _ids(12, 2), _ids(8, 3)  # 37: the partial last block is shared
    with engine.new_session() as s:
        s.prefill(ids)
        anchor = s.anchor("manual")
        s.prefill(detour)
        assert s.rollback(anchor) is anchor
        assert s.token_ids == ids and s.cached_tokens == 37
        got = _decode_all(s, cont)
    assert torch.allclose(got, _fresh_logits(engine, ids + cont, 8), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_rollback_across_branches(arch, engine_for):
    engine = engine_for(arch)
    root, branch_a, branch_b, cont = _ids(20, 4), _ids(10, 5), _ids(13, 6), _ids(5, 7)
    with engine.new_session() as s:
        s.prefill(root)
        r = s.anchor("system_prompt")
        s.prefill(branch_a)
        a = s.anchor("tool_call")
        s.rollback(r)
        s.prefill(branch_b)
        b = s.anchor("tool_result")
        assert a.parent_id == r.id and b.parent_id == r.id
        s.rollback(a, validate="full")  # a is not an ancestor of the current position
        got_a = _decode_all(s, cont)
        s.rollback(b.id)
        got_b = _decode_all(s, cont)
    with engine.new_session() as other:  # any session can roll back to any anchor of the engine
        other.rollback(a)
        got_a2 = _decode_all(other, cont)
    expected_a = _fresh_logits(engine, root + branch_a + cont, 5)
    assert torch.allclose(got_a, expected_a, atol=ATOL, rtol=0)
    assert torch.allclose(got_a2, expected_a, atol=ATOL, rtol=0)
    assert torch.allclose(got_b, _fresh_logits(engine, root + branch_b + cont, 5), atol=ATOL, rtol=0)


def test_pending_tokens_are_part_of_the_anchor(engine_for):
    engine = engine_for()
    ids = _ids(21, 8)
    with engine.new_session() as s:
        s.prefill(ids)
        s.append_unprocessed(7)
        anchor = s.anchor("manual")
        assert (anchor.position, anchor.kv_length) == (22, 21)
        s.prefill(_ids(4, 9))
        s.rollback(anchor)
        assert s.token_ids == [*ids, 7] and s.cached_tokens == 21
        got = s.decode(8)
    assert torch.allclose(got, _fresh_logits(engine, [*ids, 7, 8], 1)[0], atol=ATOL, rtol=0)


# ---- validation -------------------------------------------------------------------------------------
def test_corruption_in_signature_range_raises_and_leaves_session_unchanged(engine_for):
    engine = engine_for()
    pool = engine.kv_pool
    first, last = pool.layer_streams[0][0].name, pool.layer_streams[-1][-1].name
    anchor = _closed_anchor(engine, _ids(40, 10))
    other, nxt = _ids(9, 11), 5
    with engine.new_session() as s:
        s.prefill(other)
        before = _state(s)
        for layer, stream, position in [(0, first, 0), (len(pool.layer_streams) - 1, last, 39)]:
            slot = int(anchor.table.slots[position])
            _flip_byte(engine, layer, stream, slot)
            for mode in ("signature", "full"):
                with pytest.raises(AnchorValidationError, match="first/last 512 bytes"):
                    s.rollback(anchor, validate=mode)
                assert _state(s) == before
            _flip_byte(engine, layer, stream, slot)  # undo
        got = s.decode(nxt)
        s.rollback(anchor)  # intact again
    assert torch.allclose(got, _fresh_logits(engine, [*other, nxt], 1)[0], atol=ATOL, rtol=0)


def test_full_validation_catches_mid_cache_corruption_the_signature_misses(engine_for):
    engine = engine_for()
    anchor = _closed_anchor(engine, _ids(60, 12))
    middle = len(engine.kv_pool.layer_streams) // 2
    _flip_byte(engine, middle, engine.kv_pool.layer_streams[middle][0].name, int(anchor.table.slots[20]))
    with engine.new_session() as s:
        s.prefill(_ids(5, 13))
        before = _state(s)
        with pytest.raises(AnchorValidationError, match=r"block 1 \(positions 16\.\.31\)"):
            s.rollback(anchor, validate="full")
        assert _state(s) == before
        with pytest.raises(AnchorValidationError, match=r"block 1 \(positions 16\.\.31\)"):
            s.rollback(anchor, validate="blocks")  # what the engine's default runs
        s.rollback(anchor, validate="signature")  # the opt-in signature alone does not see it
        assert s.token_ids == list(anchor.token_ids)


def test_wrong_token_id_is_caught(engine_for):
    engine = engine_for()
    anchor = _closed_anchor(engine, _ids(30, 14))
    tampered = (anchor.token_ids[0] + 1, *anchor.token_ids[1:])
    object.__setattr__(anchor, "token_ids", tampered)  # plant the corruption behind the frozen record
    with engine.new_session() as s:
        s.prefill([1, 2, 3])
        before = _state(s)
        with pytest.raises(AnchorValidationError, match="token ids"):
            s.rollback(anchor)
        assert _state(s) == before


def test_unknown_or_evicted_anchor_raises_not_found(engine_for):
    engine = engine_for()
    anchor = _closed_anchor(engine, _ids(18, 15))
    with engine.new_session() as s:
        s.prefill([4, 5])
        before = _state(s)
        with pytest.raises(AnchorNotFoundError):
            s.rollback("0" * 64)
        assert _state(s) == before
        assert engine.anchors.discard(anchor.id)
        before = _state(s)
        with pytest.raises(AnchorNotFoundError):
            s.rollback(anchor)
        assert _state(s) == before
    assert engine.kv_pool.blocks_in_use == 0


# ---- identity ---------------------------------------------------------------------------------------
class _TieredStub:
    """The real provider plus the optional snapshot/restore methods (a stand-in for tiered memory)."""

    def __init__(self, inner) -> None:
        self.inner, self.state, self.restored = inner, {"fast": [(0, 1)], "host": [(2, 3)]}, []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def snapshot_state(self):
        return self.state

    def restore_state(self, state) -> None:
        self.restored.append(state)


def test_record_is_immutable_content_addressed_and_listed(engine_for):
    engine = engine_for()
    with engine.new_session() as s:
        s.prefill(_ids(19, 16))
        a = s.anchor("tool_call", label="search")
        assert s.anchor("tool_call") is a  # identical state: the stored record
        s.prefill([9])
        b = s.anchor("code_block")
        with pytest.raises(AnchorError, match="kind"):
            s.anchor("bogus")
        assert len(a.id) == 64 and int(a.id, 16) >= 0 and a.label == "search"
        assert engine.anchors.list_by(session_id=s.id) == [a, b]
        assert engine.anchors.list_by(kind="code_block") == [b] and b.parent_id == a.id
        with pytest.raises(dataclasses.FrozenInstanceError):
            a.position = 3  # type: ignore[misc]


def test_same_tokens_different_expert_state_or_model_have_different_ids(
    engine_for, tiny_checkpoint, tmp_path
):
    path = tiny_checkpoint("qwen3_moe")
    engine = Engine.from_pretrained(path)
    stub = _TieredStub(engine.experts)
    engine.experts = stub
    engine.model.attach_experts(stub)
    ids = _ids(25, 17)
    with engine.new_session() as s:
        s.prefill(ids)
        a1 = s.anchor("manual")
        stub.state = {"fast": [(2, 3)], "host": [(0, 1)]}
        a2 = s.anchor("manual")
        assert a1.id != a2.id and a1.kv_digest == a2.kv_digest
        s.rollback(a1)
    assert stub.restored[-1] == {"fast": [(0, 1)], "host": [(2, 3)]}
    other = Engine.from_pretrained(build_tiny_model("qwen3_moe", tmp_path / "seed1", seed=1))
    assert other.model_fingerprint != engine_for().model_fingerprint
    with other.new_session() as s:
        s.prefill(ids)
        assert s.anchor("manual").id not in (a1.id, a2.id)


def test_near_duplicate_contexts_restore_the_right_one(engine_for):
    engine = engine_for()
    ids = _ids(40, 18)
    ids2 = list(ids)
    ids2[30] = (ids2[30] + 1) % 480
    with engine.new_session() as s:
        s.prefill(ids)
        a1 = s.anchor("manual")
        s.truncate(30)
        s.prefill(ids2[30:])
        a2 = s.anchor("manual")
        assert a1.id != a2.id
        s.rollback(a1)
        got1 = s.decode(3)
        s.rollback(a2)
        got2 = s.decode(3)
    assert torch.allclose(got1, _fresh_logits(engine, [*ids, 3], 1)[0], atol=ATOL, rtol=0)
    assert torch.allclose(got2, _fresh_logits(engine, [*ids2, 3], 1)[0], atol=ATOL, rtol=0)
    assert not torch.allclose(got1, got2, atol=1e-3)


# ---- cost and memory --------------------------------------------------------------------------------
def test_anchor_creation_does_not_hash_the_cache(engine_for):
    engine = engine_for()
    pool, bs = engine.kv_pool, engine.kv_pool.block_size
    costs = []
    for n in (20, 100, 196):  # same partial-block fill (4), context 5x and 10x longer
        with engine.new_session() as s:
            calls = pool.digest_calls
            s.prefill(_ids(n, n))
            assert pool.digest_calls - calls == n // bs  # each full block hashed once, when it filled
            calls, hashed, copied = pool.digest_calls, pool.digested_bytes, pool.copied_bytes
            anchor = s.anchor("manual")
            costs.append(
                (pool.digest_calls - calls, pool.digested_bytes - hashed, pool.copied_bytes - copied)
            )
            calls = pool.digest_calls
            s.rollback(anchor, validate="signature")
            assert pool.digest_calls == calls  # a signature rollback hashes no block
    assert costs[0] == costs[1] == costs[2] == (1, 4 * pool.bytes_per_block // bs, 0)


def test_twenty_anchors_along_one_branch_cost_one_kv_cache(engine_for):
    engine = engine_for()
    pool, bs = engine.kv_pool, engine.kv_pool.block_size
    with engine.new_session() as s:
        anchors = []
        for i in range(20):
            s.prefill(_ids(11, 100 + i))  # 220 tokens: most anchors sit inside a block
            anchors.append(s.anchor("tool_result"))
        one_cache = -(-220 // bs)
        assert pool.blocks_in_use <= 1.1 * one_cache
        assert pool.blocks_in_use == one_cache and engine.anchors.used_bytes == 0
        copied = pool.copied_bytes
        s.rollback(anchors[9])  # 110 tokens: inside block 6
        assert pool.copied_bytes == copied  # rollback itself copies nothing
        s.decode(1)
        assert pool.copied_bytes - copied == pool.bytes_per_block  # only the partial block, on write


def test_lru_eviction_respects_pins(engine_for):
    engine = engine_for()
    store, block = engine.anchors, engine.kv_pool.bytes_per_block
    a1, a2, a3 = (_closed_anchor(engine, _ids(32, 200 + i)) for i in range(3))  # 2 own blocks each
    assert store.used_bytes == 6 * block and store.exclusive_bytes(a1.id) == 2 * block
    store.pin(a1.id)
    store.byte_budget = 6 * block
    store.get(a2.id)  # refresh: a3 is now the coldest unpinned anchor
    a4 = _closed_anchor(engine, _ids(32, 203))
    assert [a.id for a in store] == [a1.id, a2.id, a4.id]
    store.byte_budget = 2 * block
    assert [a.id for a in store] == [a1.id] and engine.kv_pool.blocks_in_use == 2
    with engine.new_session() as s:
        s.prefill([1])
        with pytest.raises(AnchorNotFoundError):
            s.rollback(a3)


def test_full_kv_pool_evicts_cold_anchors_first(tiny_checkpoint, engine_for):
    block = engine_for().kv_pool.bytes_per_block
    engine = Engine.from_pretrained(tiny_checkpoint("qwen3_moe"), memory=MemoryBudget(kv_bytes=6 * block))
    pinned = _closed_anchor(engine, _ids(32, 300))
    engine.anchors.pin(pinned.id)
    cold = _closed_anchor(engine, _ids(32, 301))
    with engine.new_session() as s:
        s.prefill(_ids(40, 302))  # needs 3 blocks, 2 free: evicts `cold`, keeps the pinned one
        assert cold.id not in engine.anchors and pinned.id in engine.anchors
        with pytest.raises(MemoryBudgetError):
            s.prefill(_ids(30, 303))


# ---- persistence ------------------------------------------------------------------------------------
def _saved(engine: Engine, folder: Path):
    with engine.new_session() as s:
        s.prefill(_ids(45, 20))
        a = s.anchor("system_prompt")
        s.prefill(_ids(6, 21))
        b = s.anchor("tool_call", label="t")
        engine.anchors.pin(a.id)
        s.rollback(b)
        expected = _decode_all(s, _ids(6, 22))
    engine.anchors.save(folder)
    return a, b, expected


def test_save_load_in_a_fresh_engine_gives_identical_logits(engine_for, tiny_checkpoint, tmp_path):
    a, b, expected = _saved(engine_for(), tmp_path / "anchors")
    engine = Engine.from_pretrained(tiny_checkpoint("qwen3_moe"))
    loaded = {x.id: x for x in engine.anchors.load(tmp_path / "anchors")}
    assert set(loaded) == {a.id, b.id} and engine.anchors.is_pinned(a.id)
    la, lb = loaded[a.id], loaded[b.id]
    assert (lb.kind, lb.label, lb.parent_id, lb.token_ids) == ("tool_call", "t", a.id, b.token_ids)
    assert la.blocks[:2] == lb.blocks[:2]  # blocks shared in memory are shared again
    with engine.new_session() as s:
        s.rollback(b.id, validate="full")
        assert torch.equal(_decode_all(s, _ids(6, 22)), expected)


_CHILD = """
import json, sys, torch
from freetoken_agents.engine import Engine
engine = Engine.from_pretrained(sys.argv[1])
engine.anchors.load(sys.argv[2])
with engine.new_session() as s:
    s.rollback(sys.argv[3])
    tokens = [int(s.decode(3).argmax())]
    for _ in range(7):
        tokens.append(int(s.decode(tokens[-1]).argmax()))
print(json.dumps(tokens))
"""


def test_resume_in_a_new_process_decodes_identical_tokens(engine_for, tiny_checkpoint, tmp_path):
    engine = engine_for()
    _, b, _ = _saved(engine, tmp_path / "anchors")
    with engine.new_session() as s:
        s.rollback(b)
        tokens = [int(s.decode(3).argmax())]
        for _ in range(7):
            tokens.append(int(s.decode(tokens[-1]).argmax()))
    args = [str(tiny_checkpoint("qwen3_moe")), str(tmp_path / "anchors"), b.id]
    out = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == tokens


def test_load_refuses_an_anchor_from_another_model(engine_for, tmp_path):
    _, b, _ = _saved(engine_for("qwen3_moe"), tmp_path / "anchors")
    other_arch = engine_for("mixtral")
    other_seed = Engine.from_pretrained(build_tiny_model("qwen3_moe", tmp_path / "seed1", seed=1))
    for engine in (other_arch, other_seed):
        with pytest.raises(AnchorFingerprintError, match="another model"):
            engine.anchors.load(tmp_path / "anchors")
        assert len(engine.anchors) == 0 and engine.kv_pool.blocks_in_use == 0
    with other_seed.new_session() as s:  # a live record from another engine: refused, not restored
        s.prefill([1, 2])
        before = _state(s)
        with pytest.raises(AnchorFingerprintError, match="another model"):
            s.rollback(b)
        assert _state(s) == before


def test_load_refuses_truncated_or_tampered_files(engine_for, tmp_path):
    folder = tmp_path / "anchors"
    _saved(engine_for(), folder)
    engine = engine_for()  # store cleared: loading starts from nothing
    kv_path = folder / json.loads((folder / "anchors.json").read_text())["kv_file"]  # kv-<sha256>...
    kv, meta = kv_path.read_bytes(), (folder / "anchors.json").read_text()
    kv_path.write_bytes(kv[: len(kv) // 2])
    with pytest.raises(AnchorFileError, match="truncated"):
        engine.anchors.load(folder)
    kv_path.write_bytes(kv)
    (folder / "anchors.json").write_text(meta[: len(meta) // 2])
    with pytest.raises(AnchorFileError):
        engine.anchors.load(folder)
    doc = json.loads(meta)
    doc["anchors"][1]["token_ids"][3] += 1
    (folder / "anchors.json").write_text(json.dumps(doc))
    with pytest.raises(AnchorFileError, match="changed after it was saved"):
        engine.anchors.load(folder)
    assert len(engine.anchors) == 0 and engine.kv_pool.blocks_in_use == 0
    (folder / "anchors.json").write_text(meta)
    assert len(engine.anchors.load(folder)) == 2


def test_an_anchor_two_holders_created_survives_until_both_discard_it(engine_for):
    """Anchors are content-addressed: a context's own anchor and a prefix cache's pin of the same
    state are one record. The bug: the first holder to discard it (a ChatFreeToken call closing
    its context) removed it under the other, so the cache's next restore found no anchor."""
    engine = engine_for()
    with engine.new_session() as s:
        s.prefill(_ids(21, 16))
        mine, theirs = s.anchor("tool_call"), s.anchor("manual")
        assert mine.id == theirs.id
        assert engine.anchors.discard(mine.id)
        assert theirs.id in engine.anchors  # still held by the second holder
        s.prefill(_ids(5, 3))
        s.rollback(theirs)
        assert s.position == theirs.position
        assert engine.anchors.discard(theirs.id)
        assert theirs.id not in engine.anchors
