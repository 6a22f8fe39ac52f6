"""Hostile model configs (issue 59, items 5 and 8): every hyper-parameter of a config.json or of a
GGUF file's metadata is checked against sane ranges, against the other values and against the
tensors present before anything is built from it; a bad one is one `CheckpointError` line naming
the key and the value. Never a loop over 2**31 layers, a raw traceback, a model with 0 layers or 0
experts that answers, or NaN logits. The seeded fuzz of `bench/fuzz_config.py` runs 30 cases here."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
import transformers
from gguf_models import GGUF_ARCH, write_gguf
from safetensors.torch import save_file
from tiny_models import ARCHS

from freetoken_agents.engine import Engine
from freetoken_agents.engine.adapters import _ADAPTERS, adapter_for
from freetoken_agents.engine.checkpoint import config_from_dict
from freetoken_agents.engine.errors import CheckpointError
from freetoken_agents.engine.simulate.builtin_models import BUILTIN_CONFIGS

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import fuzz_config  # noqa: E402  (bench/: the fuzzer's mutations and case runner)

U32, I32, F32, STR = (gguf.GGUFValueType[t] for t in ("UINT32", "INT32", "FLOAT32", "STRING"))
NAN, INF = math.nan, math.inf
TINY_LINEAR = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 1e-300}  # inv_freq / factor: inf


@pytest.fixture(scope="module")
def folders(tiny_checkpoint) -> dict[str, Path]:
    """The session's tiny checkpoint of every architecture (conftest)."""
    return {arch: tiny_checkpoint(arch) for arch in ARCHS}


def mutated(
    src: Path, dst: Path, changes: dict[str, Any] | None = None, text: str | bytes | None = None
) -> Path:
    """A copy of checkpoint `src` at `dst` (weights linked) whose config.json has `changes`
    (``rope_parameters.x``: one rope field), or is `text`."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    for key, value in (changes or {}).items():
        where, _, name = key.rpartition(".")
        target = config[where] if where else config
        target[name] = value
    data = text if text is not None else json.dumps(config)
    (dst / "config.json").write_bytes(data if isinstance(data, bytes) else data.encode())
    return dst


def refused(path: Path, **kwargs: Any) -> str:
    """The one-line CheckpointError message loading `path` raises."""
    with pytest.raises(CheckpointError) as info:
        Engine.from_pretrained(path, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---- item 5: 2**31 layers fail before anything is built ----------------------------------------------
def test_two_to_the_31_layers_fail_before_anything_is_built(folders, ggufs, tmp_path, monkeypatch):
    """config.json's num_hidden_layers and GGUF's block_count at 2**31, for every architecture:
    CheckpointError from the checks, raised before transformers builds a config (gpt-oss's and
    qwen2-moe's config classes loop over the layers) or an adapter builds a spec (a loop over the
    layers): both are made to fail the test here, so a regression fails fast instead of hanging."""

    class NoConfigs:
        def __getitem__(self, model_type: str) -> None:
            raise AssertionError(f"a transformers {model_type} config was built")

    def no_spec(self: object, config: object) -> None:
        raise AssertionError("a spec was built")

    monkeypatch.setattr(transformers, "CONFIG_MAPPING", NoConfigs())
    for adapter in _ADAPTERS:
        monkeypatch.setattr(type(adapter), "make_spec", no_spec)
    for arch in ARCHS:
        path = mutated(folders[arch], tmp_path / arch, {"num_hidden_layers": 2**31})
        assert "'num_hidden_layers' is 2147483648; expected an integer in [1, 1024]" in refused(path)
    bad = _rewrite(ggufs["qwen3_moe"], tmp_path / "b.gguf", {"qwen3moe.block_count": (2**31, U32)})
    assert "'qwen3moe.block_count' is 2147483648" in refused(bad, cache_dir=tmp_path / "cache")


# ---- item 8: config.json values, through Engine.from_pretrained -----------------------------------
HF_CASES = [
    ("qwen3_moe", {"num_hidden_layers": -1}, "'num_hidden_layers' is -1"),
    ("qwen3_moe", {"num_hidden_layers": 0}, "'num_hidden_layers' is 0"),
    ("qwen3_moe", {"num_hidden_layers": True}, "'num_hidden_layers' is True"),
    ("qwen3_moe", {"num_hidden_layers": 3.0}, "'num_hidden_layers' is 3.0"),
    ("olmoe", {"num_hidden_layers": 2}, "'num_hidden_layers' is 2; expected the 3 layers"),
    ("mixtral", {"num_hidden_layers": 4}, "'num_hidden_layers' is 4; expected at most the 3 layer"),
    ("qwen3_moe", {"num_experts_per_tok": 0}, "'num_experts_per_tok' is 0"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "'num_experts_per_tok' is 9; expected an integer in [1, 8]"),
    ("qwen3_moe", {"rope_parameters.rope_theta": NAN}, "'rope_parameters.rope_theta' is nan"),
    ("mixtral", {"rope_parameters.rope_theta": -INF}, "'rope_parameters.rope_theta' is -inf"),
    ("deepseek_v3", {"rope_parameters.rope_theta": 0}, "'rope_parameters.rope_theta' is 0"),
    ("gpt_oss", {"rope_parameters.factor": -2.0}, "'rope_parameters.factor' is -2.0"),
    ("olmoe", {"rms_norm_eps": -1e-6}, "'rms_norm_eps' is -1e-06"),
    ("qwen2_moe", {"rms_norm_eps": NAN}, "'rms_norm_eps' is nan"),
    ("qwen3_moe", {"hidden_size": -64}, "'hidden_size' is -64"),
    ("qwen3_moe", {"num_attention_heads": 0}, "'num_attention_heads' is 0"),
    ("qwen3_moe", {"num_local_experts": "eight"}, "'num_local_experts' is 'eight'"),
    ("mixtral", {"num_local_experts": "eight"}, "'num_local_experts' is 'eight'"),
    ("deepseek_v3", {"n_routed_experts": "eight"}, "'n_routed_experts' is 'eight'"),
    ("qwen3_moe", {"head_dim": 2**31}, "'head_dim' is 2147483648"),
    ("qwen3_moe", {"vocab_size": 2**40}, "'vocab_size' is 1099511627776"),
    (
        "mixtral",
        {"num_attention_heads": 3},
        "'num_attention_heads' is 3; expected a divisor of hidden_size 64",
    ),
    ("qwen3_moe", {"num_key_value_heads": 3}, "'num_key_value_heads' is 3; expected a divisor"),
    ("qwen2_moe", {"num_key_value_heads": None}, "'num_key_value_heads' is None"),
    ("qwen3_moe", {"norm_topk_prob": "false"}, "'norm_topk_prob' is 'false'"),
    ("deepseek_v3", {"n_group": 3}, "'n_group' is 3; expected a divisor of n_routed_experts 8 leaving 2+"),
    ("deepseek_v3", {"n_group": 8}, "'n_group' is 8; expected a divisor of n_routed_experts 8 leaving 2+"),
    ("deepseek_v3", {"topk_group": 5}, "'topk_group' is 5; expected at most n_group 4"),
    ("deepseek_v3", {"first_k_dense_replace": 3}, "'first_k_dense_replace' is 3"),
    ("gpt_oss", {"layer_types": ["sliding_attention"]}, "'layer_types' is ['sliding_attention']"),
    ("qwen2_moe", {"mlp_only_layers": [7]}, "'mlp_only_layers' is 7; expected an integer in [0, 2]"),
    ("qwen3_moe", {"rope_parameters": "yarn"}, "'rope_parameters' is 'yarn'"),
    ("qwen3_moe", {"rope_parameters": TINY_LINEAR}, "the rope parameters give non-finite or zero rotary"),
    ("gpt_oss", {"rope_parameters.attention_factor": 1e6}, "'rope_parameters.attention_factor' is 1000000.0"),
]


@pytest.mark.parametrize(("arch", "changes", "message"), HF_CASES, ids=[f"{c[0]}-{c[2]}" for c in HF_CASES])
def test_bad_config_values_are_named(folders, tmp_path, arch, changes, message):
    path = mutated(folders[arch], tmp_path / "m", changes)
    got = refused(path)
    assert message in got and str(path / "config.json") in got


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"model_type": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested too deeply"),
        ('{"model_type": "qwen3_moe", ', "cannot parse"),
        ('["model_type"]', "holds a JSON list, not an object"),
        ('{"model_type": "qwen3_moe", "x": ' + "9" * 5000 + "}", "cannot parse"),
        (b'{"model_type": "qwen3\xff_moe"}', "cannot parse"),
        ('{"model_type": 7}', "'model_type' is 7"),
    ],
    ids=["deep", "truncated", "list", "digits", "utf8", "model_type"],
)
def test_unreadable_config_json_is_a_checkpoint_error(folders, tmp_path, text, message):
    got = refused(mutated(folders["qwen3_moe"], tmp_path / "m", text=text))
    assert message in got and "config.json" in got


def test_layers_past_the_config_are_refused_but_deepseek_mtp_layers_are_not(folders, tmp_path):
    """A checkpoint holding a layer the config leaves out would load a truncated model; DeepSeek's
    multi-token-prediction layer (eh_proj, after the model's layers) is not one of its layers."""
    extra = mutated(folders["qwen3_moe"], tmp_path / "extra")
    save_file({"model.layers.3.input_layernorm.weight": torch.ones(64)}, str(extra / "more.safetensors"))
    assert "'num_hidden_layers' is 3; expected the 4 layers" in refused(extra)
    mtp = mutated(folders["deepseek_v3"], tmp_path / "mtp")
    save_file({"model.layers.3.eh_proj.weight": torch.ones(64, 128)}, str(mtp / "more.safetensors"))
    Engine.from_pretrained(mtp).close()


def test_released_models_configs_pass_the_checks():
    """The caps are far above real models: every built-in config (DeepSeek-V3, Qwen3, gpt-oss...)
    builds its spec."""
    for name, raw in BUILTIN_CONFIGS.items():
        spec = adapter_for(raw["model_type"]).build_spec(config_from_dict(raw, name))
        assert spec.num_layers == raw["num_hidden_layers"], name


# ---- item 8: GGUF metadata, through Engine.from_pretrained -----------------------------------------
def _rewrite(src: Path, dst: Path, meta: dict[str, tuple[Any, Any] | None]) -> Path:
    """A copy of GGUF `src` at `dst` with metadata values replaced (key -> (value, GGUF type)) or
    dropped (key -> None)."""
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    meta = dict(meta)
    for key, fld in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in meta:
            item = meta.pop(key)
            if item is not None:
                w.add_key_value(key, *item)
            continue
        vtype = fld.types[0]
        sub = fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, fld.contents(), vtype, sub_type=sub)
    for key, item in meta.items():
        if item is not None:
            w.add_key_value(key, *item)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


GGUF_CASES = [
    ("qwen3_moe", "block_count", (-1, I32), "is -1; expected an integer in [1, 1024]"),
    ("qwen3_moe", "block_count", (2, U32), "is 2; expected the 3 layers the checkpoint holds"),
    ("qwen3_moe", "expert_used_count", (0, U32), "is 0"),
    ("mixtral", "expert_used_count", (9, U32), "is 9; expected an integer in [1, 8]"),
    ("qwen3_moe", "rope.freq_base", (NAN, F32), "is nan"),
    ("gpt_oss", "attention.layer_norm_rms_epsilon", (-1e-5, F32), "is -9.99"),
    ("qwen3_moe", "embedding_length", (-64, I32), "is -64"),
    ("olmoe", "attention.head_count", (0, U32), "is 0"),
    ("qwen3_moe", "expert_count", ("eight", STR), "is 'eight'"),
    ("qwen3_moe", "attention.key_length", (2**31, U32), "is 2147483648"),
    ("deepseek_v3", "expert_used_count", (5, U32), "is 5; expected at most 4 (topk_group 2 groups of 2"),
    ("qwen2_moe", "attention.head_count_kv", (3, U32), "is 3; expected a divisor of num_attention_heads 4"),
]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    archs = sorted({case[0] for case in GGUF_CASES})
    return {arch: write_gguf(arch, root / arch).path for arch in archs}


@pytest.mark.parametrize(
    ("arch", "key", "value", "message"), GGUF_CASES, ids=[f"{c[0]}-{c[1]}" for c in GGUF_CASES]
)
def test_bad_gguf_metadata_values_are_named(ggufs, tmp_path, arch, key, value, message):
    name = f"{GGUF_ARCH[arch]}.{key}"
    bad = _rewrite(ggufs[arch], tmp_path / "bad.gguf", {name: value})
    got = refused(bad, cache_dir=tmp_path / "cache")
    assert f"bad.gguf: '{name}' {message}" in got


def test_gguf_without_a_required_key_is_named(ggufs, tmp_path):
    bad = _rewrite(ggufs["qwen3_moe"], tmp_path / "bad.gguf", {"qwen3moe.expert_used_count": None})
    got = refused(bad, cache_dir=tmp_path / "cache")
    assert "bad.gguf: GGUF metadata has no 'qwen3moe.expert_used_count'" in got


# ---- the seeded fuzz, in-process -----------------------------------------------------------------
def test_seeded_config_fuzz_raises_only_engine_errors(tmp_path, folders):
    """30 mutated configs (every architecture): each loads and gives finite logits, or raises an
    EngineError subclass."""
    outcomes = [fuzz_config.run_case(folders, 7, i, tmp_path) for i in range(30)]
    bad = [o for o in outcomes if not o.engine_error]
    assert not bad, bad
    assert {o.arch for o in outcomes} == set(ARCHS)
    # the mutations reach both sides: refused configs and configs that still load
    assert sum(o.result == "CheckpointError" for o in outcomes) >= 10
    assert any(o.result == "ok" for o in outcomes)
