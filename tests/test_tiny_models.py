"""Checks for the tiny random MoE fixtures in tiny_models.py."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import transformers
from tiny_models import (
    ARCHS,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_SIZE,
    build_tiny_model,
    build_tiny_tokenizer,
    hub_style_config,
    load_reference,
    safetensors_layout,
    saved_config,
    tiny_config,
)

# Router modules: every one returns (router_logits, top_k_weights, top_k_indices).
_ROUTER_SUFFIXES = (".mlp.gate", ".block_sparse_moe.gate", ".mlp.router")


def _input_ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(len(SPECIAL_TOKENS), TOKENIZER_VOCAB_SIZE, (1, n), generator=g)


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """arch -> (path, reference model); each arch is built once per module."""
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            path = build_tiny_model(arch, tmp_path_factory.mktemp(arch))
            cache[arch] = (path, load_reference(path))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_saved_files(arch, built):
    path, _ = built(arch)
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert (path / name).is_file(), name
    cfg = saved_config(path)
    assert cfg["model_type"] == arch
    assert cfg["vocab_size"] == 512 and cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == 3
    n_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    assert n_experts == 8 and cfg["num_experts_per_tok"] == 2
    assert cfg["eos_token_id"] == EOS_TOKEN_ID and cfg["pad_token_id"] == PAD_TOKEN_ID
    assert "rope_parameters" in cfg


def test_config_details(built):
    # key name quirks of save_pretrained in transformers 5
    assert "num_local_experts" in saved_config(built("mixtral")[0])
    assert "num_experts" in saved_config(built("qwen2_moe")[0])
    q3 = saved_config(built("qwen3_moe")[0])
    assert "num_local_experts" in q3 and "num_experts" not in q3 and q3["norm_topk_prob"] is True
    ol = saved_config(built("olmoe")[0])
    assert "num_experts" in ol and ol["clip_qkv"] and ol["norm_topk_prob"] is False
    ds = saved_config(built("deepseek_v3")[0])
    assert ds["n_routed_experts"] == 8 and ds["n_group"] == 4 and ds["topk_group"] == 2
    assert ds["first_k_dense_replace"] == 1 and ds["q_lora_rank"] == 32 and ds["rope_interleave"] is True
    q2 = saved_config(built("qwen2_moe")[0])
    assert q2["mlp_only_layers"] == [1] and q2["shared_expert_intermediate_size"] > 0 and q2["qkv_bias"]
    go = saved_config(built("gpt_oss")[0])
    assert go["rope_parameters"]["rope_type"] == "yarn"
    assert go["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert go["sliding_window"] == 8


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_and_routing(arch, built):
    _, model = built(arch)
    assert not model.training
    assert model.config._experts_implementation == "eager"
    assert model.config._attn_implementation == "eager"
    picks: dict[str, torch.Tensor] = {}
    hooks = [
        mod.register_forward_hook(lambda m, a, out, name=name: picks.__setitem__(name, out[-1].detach()))
        for name, mod in model.named_modules()
        if name.endswith(_ROUTER_SUFFIXES)
    ]
    try:
        with torch.no_grad():
            logits = model(_input_ids(12)).logits
    finally:
        for h in hooks:
            h.remove()
    assert logits.shape == (1, 12, 512)
    assert torch.isfinite(logits).all()
    assert logits.std().item() > 0.1
    assert logits[0].argmax(-1).unique().numel() > 1
    expected_moe_layers = {"qwen2_moe": 2, "deepseek_v3": 2}.get(arch, 3)
    assert len(picks) == expected_moe_layers, sorted(picks)
    for name, idx in picks.items():
        assert idx.shape == (12, 2), name
        sets = {tuple(sorted(row.tolist())) for row in idx}
        assert len(sets) > 1, f"{name}: every token picked the same experts"
        assert idx.unique().numel() >= 4, f"{name}: only {idx.unique().tolist()} used"


@pytest.mark.parametrize("arch", ARCHS)
def test_deterministic(arch, built):
    path, model = built(arch)
    ids = _input_ids(12, seed=1)
    with torch.no_grad():
        a = model(ids).logits
        b = load_reference(path)(ids).logits
    assert torch.equal(a, b)


def test_rebuild_is_byte_identical(tmp_path):
    a = build_tiny_model("qwen3_moe", tmp_path / "a")
    b = build_tiny_model("qwen3_moe", tmp_path / "b")
    c = build_tiny_model("qwen3_moe", tmp_path / "c", seed=1, with_tokenizer=False)
    assert _sha(a / "model.safetensors") == _sha(b / "model.safetensors")
    assert _sha(a / "tokenizer.json") == _sha(b / "tokenizer.json")
    assert _sha(a / "model.safetensors") != _sha(c / "model.safetensors")
    assert not (c / "tokenizer.json").exists()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate(arch, built):
    _, model = built(arch)
    ids = _input_ids(12)
    # eos_token_id=None overrides generation_config's eos, so generation cannot stop early.
    out = model.generate(ids, do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=PAD_TOKEN_ID)
    assert out.shape == (1, 20)
    assert torch.equal(out[:, :12], ids)
    # greedy generate agrees with argmax of a full forward on its own output
    with torch.no_grad():
        logits = model(out).logits
    assert torch.equal(logits[0, 11:-1].argmax(-1), out[0, 12:])


def test_gpt_oss_sliding_window_and_sinks(built):
    path, model = built("gpt_oss")
    layers = model.model.layers
    assert [layer.self_attn.sliding_window for layer in layers] == [8, None, 8]
    for layer in layers:
        assert layer.self_attn.sinks.abs().min() > 0
        assert layer.mlp.experts.gate_up_proj_bias.abs().max() > 7  # SwiGLU clamp is reached
    # The window is exercised by a 32-token input: a wider window changes outputs after position 8 only.
    ids = _input_ids(32)
    wide = transformers.AutoModelForCausalLM.from_pretrained(
        path, sliding_window=64, experts_implementation="eager", attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        a, b = model(ids).logits[0], wide(ids).logits[0]
    assert torch.allclose(a[:8], b[:8], atol=1e-6)
    assert (a[8:] - b[8:]).abs().amax(-1).min() > 1e-4


def test_deepseek_buffers_and_mla(built):
    _, model = built("deepseek_v3")
    mlp0 = model.model.layers[0].mlp
    assert not hasattr(mlp0, "experts")  # first_k_dense_replace=1
    for layer in model.model.layers[1:]:
        bias = layer.mlp.gate.e_score_correction_bias
        assert bias.dtype == torch.float32 and bias.abs().min() > 0
        assert layer.mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[0].self_attn.q_a_proj.weight.shape == (32, 64)


def test_qwen2_moe_dense_layer(built):
    _, model = built("qwen2_moe")
    dense = model.model.layers[1].mlp
    assert hasattr(dense, "gate_proj") and not hasattr(dense, "experts")
    assert hasattr(model.model.layers[0].mlp, "shared_expert")
    assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_hub_style_qwen3_config(tmp_path):
    path = hub_style_config(build_tiny_model("qwen3_moe", tmp_path / "q3", with_tokenizer=False))
    cfg = saved_config(path)
    assert cfg["num_experts"] == 8 and "num_local_experts" not in cfg
    model = load_reference(path)
    assert model.config.num_experts == 8
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 64)


def test_bf16_build(tmp_path):
    path = build_tiny_model("deepseek_v3", tmp_path / "ds", dtype=torch.bfloat16, with_tokenizer=False)
    layout = safetensors_layout(path)
    assert layout["model.layers.1.mlp.experts.0.up_proj.weight"][1] == "BF16"
    assert layout["model.layers.1.mlp.gate.e_score_correction_bias"][1] == "F32"
    model = load_reference(path, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.isfinite(model(_input_ids(6)).logits).all()


def test_tiny_config_overrides():
    cfg = tiny_config("mixtral", sliding_window=16, num_hidden_layers=2)
    assert cfg.sliding_window == 16 and cfg.num_hidden_layers == 2
    assert tiny_config("mixtral").sliding_window is None
    assert tiny_config("gpt_oss", num_hidden_layers=4).layer_types == [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ]
    with pytest.raises(ValueError):
        tiny_config("llama")


def test_tokenizer(tmp_path):
    build_tiny_tokenizer(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == TOKENIZER_VOCAB_SIZE < 512
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.eos_token_id == EOS_TOKEN_ID and tok.pad_token_id == PAD_TOKEN_ID
    text = 'def f(x):\n    return {"a": 1}  # ünïcode ✓'
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok("<tool_call>")["input_ids"] == [SPECIAL_TOKENS.index("<tool_call>")]

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "21 degrees."},
        {"role": "user", "content": "Thanks"},
    ]
    prompt = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(tools[0], ensure_ascii=False) in prompt
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    assert call in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in prompt
    assert prompt.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
    # string arguments (OpenAI style) are inserted verbatim, not re-encoded
    messages[2]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris"}'
    assert tok.apply_chat_template(messages, tools=tools, tokenize=False).count('"arguments": {"city"') == 1
    plain = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    enc = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    enc = enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc
    assert enc[0] == SPECIAL_TOKENS.index("<|im_start|>")


@pytest.mark.parametrize("arch", ARCHS)
def test_print_layout(arch, built):
    """Not a check: prints the on-disk tensor names (global + last layer, expert 0) for reference."""
    path, _ = built(arch)
    layout = safetensors_layout(path)
    last = f"model.layers.{saved_config(path)['num_hidden_layers'] - 1}."
    print(f"\n[{arch}]")
    for name, (shape, dtype) in layout.items():
        if ".layers." in name and not name.startswith(last):
            continue
        if ".experts." in name and ".experts.0." not in name and name.split(".experts.")[1][0].isdigit():
            continue
        print(f"  {name} {list(shape)} {dtype}")
    assert layout
