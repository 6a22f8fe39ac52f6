"""Issue 32 ("the house"), engine corridors: one list of tokenizer files, one config loader, one
FTW block check, and the bug the scattered lists hid (the anchors' fingerprint skipped
added_tokens.json); the declared seams (ExpertStore, AnchorHost)."""

from __future__ import annotations

import json
import shutil

import pytest
from tiny_models import build_tiny_model
from transformers import AutoConfig

from freetoken_agents.engine import Engine, MemoryBudget, TieringOptions, checkpoint
from freetoken_agents.engine.anchors.host import AnchorHost
from freetoken_agents.engine.errors import FTWFormatError
from freetoken_agents.engine.ftw.reader import FTWFile
from freetoken_agents.engine.loading import ftw_load as load
from freetoken_agents.engine.loading import hub
from freetoken_agents.engine.loading.calibrate import RoutingCounter
from freetoken_agents.engine.loading.convert import EMBEDDED_FILES, convert_checkpoint
from freetoken_agents.engine.memory import BlockReader
from freetoken_agents.engine.model.experts import ExpertStore
from freetoken_agents.engine.text.stop_tokens import GENERATION_CONFIG
from freetoken_agents.engine.text.tokenizer_files import TOKENIZER_FILES, TOKENIZER_MARKERS


def test_one_list_of_tokenizer_files():
    assert len(set(TOKENIZER_FILES)) == len(TOKENIZER_FILES)
    assert set(TOKENIZER_MARKERS) <= set(TOKENIZER_FILES)
    assert "added_tokens.json" in TOKENIZER_FILES
    assert EMBEDDED_FILES == (*TOKENIZER_FILES, GENERATION_CONFIG)
    assert hub.TOKENIZER_FILES is TOKENIZER_FILES


def test_the_fingerprint_covers_added_tokens_json(tmp_path):
    """The bug: the anchors' model fingerprint did not hash added_tokens.json, so anchors saved
    under one set of added tokens were accepted by an engine whose tokenizer maps ids otherwise."""
    folder = build_tiny_model("qwen3_moe", tmp_path / "a")
    other = tmp_path / "b"
    shutil.copytree(folder, other)
    (folder / "added_tokens.json").write_text(json.dumps({"<tool_a>": 480}))
    (other / "added_tokens.json").write_text(json.dumps({"<tool_b>": 480}))
    a, b = Engine.from_pretrained(folder), Engine.from_pretrained(other)
    # transformers reads the file: the two tokenizers map id 480 to different tokens
    assert a.tokenizer.convert_ids_to_tokens(480) == "<tool_a>" != b.tokenizer.convert_ids_to_tokens(480)
    assert a.model_fingerprint != b.model_fingerprint
    a.close()
    b.close()


def test_one_config_loader(tiny_checkpoint):
    """Every source builds its transformers config with `checkpoint.config_from_dict`; from a
    folder it is what `AutoConfig.from_pretrained` builds (the path it records aside)."""
    assert load.config_from_dict is checkpoint.config_from_dict
    folder = tiny_checkpoint("qwen3_moe")
    built = checkpoint.config_from_dict(checkpoint.read_config(folder)).to_dict()
    auto = AutoConfig.from_pretrained(folder).to_dict()
    assert {k: v for k, v in built.items() if k != "_name_or_path"} == {
        k: v for k, v in auto.items() if k != "_name_or_path"
    }


@pytest.mark.parametrize("where", [0, 5, 64 + 100])  # the magic, the layer field, the stored bytes
def test_one_block_check(tiny_checkpoint, tmp_path, where):
    """The reader and the tier-3 block reader (past the page cache) refuse a damaged block with
    the same check, hence the same message."""
    path = tmp_path / "m.ftw"
    convert_checkpoint(tiny_checkpoint("qwen3_moe"), path, quant="fp32", progress=False)
    with FTWFile(path) as f:
        offset = f.expert_info(0, 1).offset
    with open(path, "r+b") as fh:
        fh.seek(offset + where)
        fh.write(b"\x13\x37")
    with FTWFile(path) as f:
        with pytest.raises(FTWFormatError) as direct:
            f.read_expert_bytes(0, 1)
        reader = BlockReader(f)
        with pytest.raises(FTWFormatError) as tier3:
            reader.read(0, 1)
        reader.close()
        messages = [str(direct.value), str(tier3.value)]
    assert messages[0] == messages[1]
    assert "expert block (layer=0, expert=1)" in messages[0]


# ---- declared seams: the expert store and the anchor host ---------------------------------------
def test_every_expert_store_declares_its_capabilities(tiny_checkpoint, tmp_path):
    """Resident, lazily read FTW and tiered stores are `ExpertStore`s: the engine calls `stats`,
    `close`, `snapshot_state` on each without probing for them, and a store missing `get` or `run`
    cannot be built."""
    folder = tiny_checkpoint("qwen3_moe")
    ftw = tmp_path / "m.ftw"
    convert_checkpoint(folder, ftw, quant="bf16", progress=False)
    tiering = TieringOptions(prefetch_thread=False)
    engines = {
        "resident": Engine.from_pretrained(folder),
        "ftw": Engine.from_pretrained(ftw),
        "tiered": Engine.from_pretrained(ftw, placement="qstar", memory=MemoryBudget(), tiering=tiering),
    }
    for name, engine in engines.items():
        assert isinstance(engine.experts, ExpertStore), name
        engine.generate([1, 2, 3], max_new_tokens=2)
        assert engine.stats()["placement"] == ("qstar" if name == "tiered" else "resident")
        assert engine.experts.snapshot_state(), name
        engine.close()
    assert engines["tiered"].experts.weights_file()[0] == ftw

    class Half(ExpertStore):
        def get(self, layer: int, expert: int):  # no run
            raise KeyError

    with pytest.raises(TypeError):
        Half()  # type: ignore[abstract]


def test_a_wrapped_store_keeps_the_inner_stores_capabilities(tiny_checkpoint, tmp_path):
    """A routing counter around the tiered store (calibration, benchmarks) reports the tiered
    stats and expert-cache state, and its anchors record the tiers: the counter used to expose
    only `keys`, so stats fell back to bare counters and anchors recorded every expert "resident"."""
    ftw = tmp_path / "m.ftw"
    convert_checkpoint(tiny_checkpoint("qwen3_moe"), ftw, quant="bf16", progress=False)
    tiering = TieringOptions(prefetch_thread=False)
    with Engine.from_pretrained(ftw, placement="qstar", memory=MemoryBudget(), tiering=tiering) as engine:
        inner = engine.experts
        engine.use_expert_provider(RoutingCounter(inner))
        with engine.new_session() as session:
            session.prefill([1, 2, 3, 4])
            anchor = session.anchor("manual")
        assert "tiers" in engine.stats()
        assert {tier for tier, _ in anchor.expert_state} == {"fast", "host"}
        engine.use_expert_provider(inner)


def test_the_anchor_store_never_holds_the_engine(tiny_checkpoint):
    """The store is built over an `AnchorHost` (pool, lock, fingerprint, expert state), after the
    KV pool it budgets; it used to be handed the whole Engine, before the pool existed."""
    with Engine.from_pretrained(tiny_checkpoint("qwen3_moe")) as engine:
        store = engine.anchors
        assert isinstance(store.host, AnchorHost)
        assert not any(isinstance(value, Engine) for value in vars(store).values())
        assert store.host.pool is engine.kv_pool and store.host.lock is engine.lock
        assert store.host.model_fingerprint == engine.model_fingerprint
