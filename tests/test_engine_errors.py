"""Bad input raises a named engine exception with a message that says what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from freetoken_agents.engine import (
    CheckpointError,
    ContextOverflowError,
    Engine,
    EngineError,
    InvalidTokenError,
    UnsupportedModelError,
)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "nope")


def test_missing_config(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("mixtral"), tmp_path / "m")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        Engine.from_pretrained(path)


def test_unknown_model_type(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("mixtral"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "llama_of_the_future"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as err:
        Engine.from_pretrained(path)
    assert "llama_of_the_future" in str(err.value) and "deepseek_v3" in str(err.value)


@pytest.mark.parametrize("missing", ["model.layers.1.self_attn.q_proj.weight", "expert"])
def test_safetensors_missing_a_tensor(tiny_checkpoint, tmp_path, missing):
    path = _copy(tiny_checkpoint("qwen3_moe"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    if missing == "expert":
        missing = "model.layers.2.mlp.experts.5.down_proj.weight"
    assert missing in tensors
    del tensors[missing]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        Engine.from_pretrained(path)


def test_no_safetensors(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("mixtral"), tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        Engine.from_pretrained(path)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint("mixtral"))


@pytest.mark.parametrize("bad", [[-1], [10**6], [1.5], [], ["a"], [True]])
def test_token_ids_out_of_range_or_wrong_type(engine, bad):
    with engine.new_session() as s, pytest.raises(InvalidTokenError):
        s.prefill(bad)
    with engine.new_session() as s:
        assert s.position == 0  # nothing was half-applied


def test_decode_rejects_non_int(engine):
    with engine.new_session() as s:
        s.prefill([1, 2])
        with pytest.raises(InvalidTokenError):
            s.decode("3")  # type: ignore[arg-type]


def test_context_overflow(engine):
    limit = engine.max_context
    with engine.new_session() as s:
        s.prefill([1] * (limit - 1))
        s.decode(2)  # exactly at the limit is fine
        with pytest.raises(ContextOverflowError, match=str(limit)):
            s.decode(3)
        assert s.position == limit
    with pytest.raises(ContextOverflowError):
        engine.generate([1] * (limit + 1), max_new_tokens=1)


def test_bad_generation_parameters(engine):
    with pytest.raises(EngineError, match="temperature"):
        engine.generate([1, 2], temperature=-1.0)


def test_closed_session(engine):
    s = engine.new_session()
    s.close()
    with pytest.raises(EngineError, match="closed"):
        s.prefill([1])


def test_truncate_out_of_range(engine):
    with engine.new_session() as s:
        s.prefill([1, 2, 3])
        with pytest.raises(EngineError):
            s.truncate(4)
