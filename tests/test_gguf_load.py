"""GGUF files at the entry points: `freetoken convert x.gguf`, `Engine.from_pretrained("x.gguf")`
through the FTW conversion cache, the tokenizer / chat template / eos ids from the metadata, and
the named errors for bad files."""

from __future__ import annotations

import io
import shutil
import sys

import pytest
import torch
from gguf_models import write_gguf
from tiny_models import EOS_TOKEN_ID

from freetoken_agents.cli import main
from freetoken_agents.engine import Engine
from freetoken_agents.engine.errors import CheckpointError, UnsupportedModelError
from freetoken_agents.engine.ftw import FTWFile
from freetoken_agents.engine.loading.gguf import convert_gguf

TEXT = 'The quick brown fox <|im_start|>user calls get_weather {"city": "Paris"}<|im_end|>\n'


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf("qwen3_moe", tmp_path_factory.mktemp("gguf"), expert_type="Q8_0")


def test_cli_convert_gguf_keeps_expert_precision(tiny, tmp_path, capsys):
    out = tmp_path / "m.ftw"
    assert main(["convert", str(tiny.path), str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert str(out) in line and "quant source" in line and "int8_b32 x48" in line
    with FTWFile(out) as f:
        assert f.metadata["source_format"] == "gguf" and f.metadata["gguf_architecture"] == "qwen3moe"
        assert {"tokenizer.json", "chat_template.jinja", "generation_config.json"} <= set(f.tokenizer_files)
    assert main(["convert", str(tiny.path), str(tmp_path / "b.ftw"), "--quant", "bf16"]) == 0
    assert "bf16 x48" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["chat", "generate"])
def test_cli_model_may_be_a_gguf_file(tiny, tmp_path, monkeypatch, capsys, command):
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    if command == "chat":
        monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n/quit\n"))
        args = ["chat", "--model", str(tiny.path), "--max-new-tokens", "4", "--no-progress"]
    else:
        args = ["generate", str(tiny.path), "--prompt", "Hi", "--max-new-tokens", "4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> ") == 1 if command == "chat" else out.strip()
    assert len(list((tmp_path / "cache" / "ftw").glob("*.ftw"))) == 1  # served from its cached conversion


def test_cli_convert_names_a_garbled_gguf(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    assert main(["convert", str(bad), str(tmp_path / "o.ftw")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("freetoken convert: error:") and str(bad) in err and "\n" not in err
    assert not (tmp_path / "o.ftw").exists()


def test_from_pretrained_gguf_is_cached_and_rebuilt_when_the_file_changes(tiny, tmp_path, monkeypatch):
    import freetoken_agents.engine.loading.gguf.convert as conv

    calls = []
    real = conv.convert_gguf
    monkeypatch.setattr(conv, "convert_gguf", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    gguf_file = tmp_path / "m.gguf"
    shutil.copy(tiny.path, gguf_file)
    cache = tmp_path / "cache"
    ids = list(range(5, 25))
    e1 = Engine.from_pretrained(gguf_file, cache_dir=cache)
    first = e1.generate(ids, max_new_tokens=4, stop_token_ids=()).token_ids
    e2 = Engine.from_pretrained(gguf_file, cache_dir=cache)
    assert len(calls) == 1  # second load: the cached FTW entry, no reconversion
    assert e2.generate(ids, max_new_tokens=4, stop_token_ids=()).token_ids == first
    assert e2.model_fingerprint == e1.model_fingerprint
    other = write_gguf("qwen3_moe", tmp_path / "other", expert_type="Q8_0", seed=1)
    shutil.copy(other.path, gguf_file)
    e3 = Engine.from_pretrained(gguf_file, cache_dir=cache)
    assert len(calls) == 2 and e3.model_fingerprint != e1.model_fingerprint


def test_tokenizer_template_and_eos_come_from_the_gguf(tiny, tmp_path):
    from transformers import AutoTokenizer

    engine = Engine.from_pretrained(tiny.path, cache_dir=tmp_path)
    ref = AutoTokenizer.from_pretrained(str(tiny.path.parent), gguf_file=tiny.path.name)
    assert engine.tokenizer.encode(TEXT) == ref.encode(TEXT)
    messages = [{"role": "user", "content": "hi"}]
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == want
    assert EOS_TOKEN_ID in engine.default_stop_token_ids()


def test_gguf_eos_and_eot_ids_end_turns(tmp_path):
    """tokenizer.ggml.eot_token_id (llama.cpp's end-of-turn) ends a turn too."""
    import gguf

    tiny = write_gguf("qwen3_moe", tmp_path / "src", expert_type="Q8_0")
    reader = gguf.GGUFReader(str(tiny.path))
    w = gguf.GGUFWriter(str(tmp_path / "eot.gguf"), "qwen3moe")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    w.add_eot_token_id(1)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    engine = Engine.from_pretrained(tmp_path / "eot.gguf", cache_dir=tmp_path / "cache")
    assert {EOS_TOKEN_ID, 1} <= set(engine.default_stop_token_ids())


def test_truncated_gguf_is_a_checkpoint_error_naming_the_file(tiny, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.path.read_bytes()[: tiny.path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="cut.gguf") as info:
        convert_gguf(cut, tmp_path / "o.ftw", progress=False)
    assert "\n" not in str(info.value)
    with pytest.raises(CheckpointError, match="cut.gguf"):
        Engine.from_pretrained(cut, cache_dir=tmp_path / "cache")


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="dense.gguf.*dense llama"):
        convert_gguf(path, tmp_path / "o.ftw", progress=False)
    path2 = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path2), "bert")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="bert.gguf.*'bert' is not supported"):
        convert_gguf(path2, tmp_path / "o.ftw", progress=False)


def test_undecodable_tensor_type_is_named(tmp_path):
    """A dense tensor of a type gguf-py cannot dequantize (Q8_1 here) -> CheckpointError."""
    import gguf

    tiny = write_gguf("qwen3_moe", tmp_path / "src", expert_type="Q8_0")
    reader = gguf.GGUFReader(str(tiny.path))
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name == "blk.0.attn_q.weight":  # [64, 64] as Q8_1: 2 blocks of 40 bytes per row
            data = torch.zeros(64, 80, dtype=torch.uint8).numpy()
            w.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
            continue
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="iq.gguf.*attn_q.weight.*Q8_1"):
        convert_gguf(path, tmp_path / "o.ftw", progress=False)


# ---- deepseek2 (DeepSeek-V3): round trip, both kv_b forms, named errors -------------------------------


def _rewrite(src, dst, *, meta=None, drop=(), extra=None):
    """A copy of GGUF `src` at `dst`: metadata replaced (`meta`: key -> (value, type); None drops the
    key), tensors in `drop` left out, `extra` tensors (name -> float32 array) added."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    meta = dict(meta or {})
    for key, fld in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = fld.types[0]
        sub = fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        if key in meta and meta[key] is None:
            continue  # dropped
        value, vtype = meta.pop(key) if key in meta else (fld.contents(), vtype)
        w.add_key_value(key, value, vtype, sub_type=sub)
    for key, item in meta.items():
        if item is not None:
            w.add_key_value(key, *item)
    for t in reader.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return write_gguf("deepseek_v3", tmp_path_factory.mktemp("ds"), expert_type="Q8_0")


def _reference_logits(tiny, ids):
    from gguf_models import load_folder_reference

    with torch.no_grad():
        return load_folder_reference(tiny)(torch.tensor([ids])).logits[0]


def test_deepseek_v3_gguf_loads_through_from_pretrained(deepseek, tmp_path):
    ids = list(range(5, 29))
    engine = Engine.from_pretrained(deepseek.path, cache_dir=tmp_path)
    with engine.new_session() as s:
        got = s.prefill(ids)
    want = _reference_logits(deepseek, ids)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    out = tmp_path / "m.ftw"
    convert_gguf(deepseek.path, out, progress=False)
    with FTWFile(out) as f:
        assert f.metadata["gguf_architecture"] == "deepseek2"
        cfg = f.model_config
        assert cfg["model_type"] == "deepseek_v3" and cfg["num_key_value_heads"] == cfg["num_attention_heads"]
        assert (cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["qk_rope_head_dim"]) == (
            32,
            16,
            12,
            8,
        )
        assert cfg["first_k_dense_replace"] == 1 and cfg["n_shared_experts"] == 1 and cfg["rope_interleave"]
        for layer in (0, 1):  # attn_k_b / attn_v_b joined back exactly
            name = f"layers.{layer}.self_attn.kv_b_proj.weight"
            assert torch.equal(f.dense(name), deepseek.reference[f"model.{name}"])
        bias = f.dense("layers.1.mlp.router.e_score_correction_bias")
        assert torch.equal(bias, deepseek.reference["model.layers.1.mlp.gate.e_score_correction_bias"])
    # tokenizer.ggml.pre "deepseek-v3": DeepSeek-V3's splits (digits by three, CJK runs, punctuation)
    pre = engine.tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x 12345 日本語!?abc")
    assert [p for p, _ in pre] == ["x", "Ġ", "123", "45", "Ġ", "æĹ¥æľ¬èªŀ", "!?", "abc"]


def test_deepseek_v3_gguf_with_whole_kv_b_older_converters(tmp_path):
    """Files from before llama.cpp's MLA split: attn_kv_b, key_length = nope + rope, head_count_kv = heads
    (and here no q compression: attn_q, as DeepSeek-V2-Lite has)."""
    tiny = write_gguf("deepseek_v3", tmp_path / "src", expert_type="Q8_0", mla="fused", q_lora_rank=None)
    assert "blk.0.attn_kv_b.weight" in tiny.tensor_types and "blk.0.attn_k_b.weight" not in tiny.tensor_types
    assert "blk.0.attn_q.weight" in tiny.tensor_types
    out = tmp_path / "m.ftw"
    convert_gguf(tiny.path, out, progress=False)
    with FTWFile(out) as f:
        assert torch.equal(
            f.dense("layers.1.self_attn.kv_b_proj.weight"),
            tiny.reference["model.layers.1.self_attn.kv_b_proj.weight"],
        )
    ids = list(range(7, 31))
    with Engine.from_pretrained(out).new_session() as s:
        got = s.prefill(ids)
    want = _reference_logits(tiny, ids)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_deepseek_v3_gguf_with_both_kv_b_forms_uses_the_split_one(deepseek, tmp_path):
    """Some files carry attn_kv_b beside attn_k_b / attn_v_b; llama.cpp computes with the split pair."""
    import numpy as np

    both = _rewrite(
        deepseek.path,
        tmp_path / "both.gguf",
        extra={"blk.1.attn_kv_b.weight": np.zeros((4 * 28, 32), np.float32)},
    )
    out = tmp_path / "m.ftw"
    convert_gguf(both, out, progress=False)
    with FTWFile(out) as f:
        assert torch.equal(
            f.dense("layers.1.self_attn.kv_b_proj.weight"),
            deepseek.reference["model.layers.1.self_attn.kv_b_proj.weight"],
        )


def test_deepseek2_softmax_routing_and_malformed_metadata_are_named(deepseek, tmp_path):
    import gguf

    u32 = gguf.GGUFValueType.UINT32
    softmax = _rewrite(deepseek.path, tmp_path / "v2.gguf", meta={"deepseek2.expert_gating_func": (1, u32)})
    unset = _rewrite(deepseek.path, tmp_path / "v2old.gguf", meta={"deepseek2.expert_gating_func": None})
    for path in (softmax, unset):  # llama.cpp reads a missing expert_gating_func as softmax
        with pytest.raises(UnsupportedModelError, match=f"{path.name}.*softmax"):
            convert_gguf(path, tmp_path / "o.ftw", progress=False)
    cases = {
        "rank.gguf": ({"deepseek2.attention.kv_lora_rank": (30, u32)}, "attn_kv_a_mqa has 40 rows"),
        "mla.gguf": (
            {"deepseek2.attention.value_length_mla": (16, u32)},
            "value_length_mla' is 16, the tensors say 12",
        ),
        "groups.gguf": ({"deepseek2.expert_group_count": (3, u32)}, "8 experts in 3 groups"),
        "dense.gguf": ({"deepseek2.leading_dense_block_count": (9, u32)}, "leaves no MoE layer"),
        "norank.gguf": (
            {"deepseek2.attention.kv_lora_rank": None},
            "'deepseek2.attention.kv_lora_rank' is missing",
        ),
    }
    for name, (meta, message) in cases.items():
        bad = _rewrite(deepseek.path, tmp_path / name, meta=meta)
        with pytest.raises(CheckpointError, match="malformed deepseek2 GGUF metadata") as info:
            convert_gguf(bad, tmp_path / "o.ftw", progress=False)
        text = str(info.value)
        assert name in text and message in text and "\n" not in text
        assert not (tmp_path / "o.ftw").exists()
