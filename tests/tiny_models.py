"""Tiny random Hugging Face MoE models (and a tiny tokenizer) for the engine's reference tests.

Everything here is deterministic and pure: the same arguments give byte-identical files. Callers that
want per-session caching wrap the builders themselves (e.g. a session-scoped pytest fixture).

Usage::

    from tiny_models import ARCHS, build_tiny_model, load_reference

    path = build_tiny_model("qwen3_moe", tmp_path / "qwen3_moe")
    ref = load_reference(path)          # eager attention + eager experts, eval mode
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")

# ---------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------

# Special tokens get ids 0..4 in this order (the BPE trainer puts them first).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN_ID = SPECIAL_TOKENS.index(PAD_TOKEN)  # 0
EOS_TOKEN_ID = SPECIAL_TOKENS.index(EOS_TOKEN)  # 2
TOKENIZER_VOCAB_SIZE = 480  # total, specials and the 256 byte symbols included; < model vocab 512
MODEL_VOCAB_SIZE = 512

_TRAINING_TEXT = r'''
The quick brown fox jumps over the lazy dog. A tool-calling agent reads the user's request, decides
which function to call, and then answers with the result. The weather in Paris is sunny today, with a
high of 21 degrees and a light wind from the west. Please book a table for two people at seven o'clock.
What is the capital of France? The capital of France is Paris. How many experts does the model route
each token to? Each token is routed to the top two experts out of eight, and their outputs are mixed.
You are a helpful assistant. Answer the question as briefly as you can, and call a tool when needed.
The user asked for the current time in Tokyo, so the assistant called the get_time function.

def get_weather(city: str, unit: str = "celsius") -> dict:
    """Return the current weather for a city."""
    if not city:
        raise ValueError("city must not be empty")
    return {"city": city, "temperature": 21, "unit": unit, "condition": "sunny"}


class Calculator:
    def __init__(self, precision: int = 2) -> None:
        self.precision = precision

    def add(self, a: float, b: float) -> float:
        return round(a + b, self.precision)

    def multiply(self, a: float, b: float) -> float:
        return round(a * b, self.precision)


for i in range(10):
    print(f"step {i}: value = {i * i}")

import json
data = json.loads('{"name": "search", "arguments": {"query": "mixture of experts", "limit": 5}}')
result = [item for item in data["arguments"].values() if item is not None]

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "search", "arguments": {"query": "python json parsing", "limit": 3}}
{"type": "function", "function": {"name": "get_time", "description": "Get the current time",
 "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
 "required": ["timezone"]}}}
{"id": 42, "ok": true, "items": [1, 2, 3], "error": null, "score": 0.75, "tags": ["a", "b"]}
<tools>
</tools>
<tool_response>
{"temperature": 21, "condition": "sunny"}
</tool_response>
'''

_TOOLS_HEAD = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)

# Hermes / Qwen2.5-style ChatML template with tool support (the Qwen2.5 template, plus string arguments).
CHAT_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- @TOOLS_HEAD@ }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- @TOOLS_TAIL@ }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
CHAT_TEMPLATE = (
    CHAT_TEMPLATE.strip()
    .replace("@TOOLS_HEAD@", json.dumps(_TOOLS_HEAD))
    .replace("@TOOLS_TAIL@", json.dumps(_TOOLS_TAIL))
)


def _train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Several copies of the text give the trainer stable counts; the result is deterministic.
    tok.train_from_iterator([_TRAINING_TEXT] * 4, trainer=trainer)
    return tok


def make_tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The tiny tokenizer object (not saved)."""
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:]),
        model_max_length=256,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_tokenizer(out_dir: Path) -> Path:
    """Train the tiny byte-level BPE tokenizer; `save_pretrained` it (chat template included) to out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    make_tiny_tokenizer().save_pretrained(out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------------------

_COMMON: dict[str, Any] = dict(
    vocab_size=MODEL_VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
    pad_token_id=PAD_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
    bos_token_id=None,
    dtype="float32",
)

_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

_ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(
        model_type="mixtral",
        intermediate_size=32,  # per expert
        num_local_experts=8,
        sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        intermediate_size=128,  # dense layers (mlp_only_layers)
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=8,
        norm_topk_prob=False,
        qkv_bias=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],  # layer 1 is a dense MLP, layers 0 and 2 are MoE
        use_sliding_window=False,
        rope_parameters=dict(_DEFAULT_ROPE),
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
        rope_parameters=dict(_DEFAULT_ROPE),
    ),
    "olmoe": dict(
        model_type="olmoe",
        intermediate_size=32,  # per expert
        num_experts=8,
        norm_topk_prob=False,
        # clip_qkv acts after q_norm/k_norm (unit scale): 1.5 clips a few % of q/k/v values, so it matters.
        clip_qkv=1.5,
        rope_parameters=dict(_DEFAULT_ROPE),
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        num_key_value_heads=4,  # MLA: no GQA
        intermediate_size=128,  # dense layers before first_k_dense_replace
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        rope_interleave=True,
        rope_parameters=dict(_DEFAULT_ROPE),
    ),
    "gpt_oss": dict(
        model_type="gpt_oss",
        head_dim=16,
        intermediate_size=32,  # per expert
        num_local_experts=8,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attention_bias=True,
        # rope_parameters left to the config default: YaRN factor 32, original 4096, theta 150000
    ),
}


def tiny_config(arch: str, **overrides: Any) -> transformers.PretrainedConfig:
    """A tiny fp32 config for `arch` (one of ARCHS); keyword overrides replace any field."""
    if arch not in _ARCH_CONFIGS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    kwargs = {**_COMMON, **_ARCH_CONFIGS[arch], **overrides}
    model_type = kwargs.pop("model_type")
    n_layers = kwargs["num_hidden_layers"]
    if arch == "gpt_oss" and "layer_types" not in overrides:
        kwargs["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(n_layers)]
    if arch == "qwen2_moe" and "mlp_only_layers" not in overrides:
        kwargs["mlp_only_layers"] = [1] if n_layers > 1 else []
    return transformers.AutoConfig.for_model(model_type, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------

_ROUTER_SUFFIXES = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight")


def _randomise_(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise every parameter (and DeepSeek's correction bias) so outputs and routing are decisive.

    - embeddings N(0, 1); other matrices N(0, 0.1) (about 0.8/sqrt(hidden)); lm_head N(0, 0.1), with the
      padding rows (ids >= TOKENIZER_VOCAB_SIZE) scaled by 0.05
    - routers N(0, 0.3): router logits of std ~2.4, top-1/top-2 clearly apart but both weights matter
    - norm weights 1 + N(0, 0.1); biases N(0, 0.1)
    - gpt-oss attention sinks N(0, 1); gpt-oss gate/up biases shifted by +-8 on every 8th channel so
      the SwiGLU clamp (limit 7) is exercised; router bias N(0, 0.3)
    - DeepSeek e_score_correction_bias N(0, 0.3) (it initialises to zeros), kept in fp32
    """
    gen = torch.Generator().manual_seed(seed + 12345)

    def rand(shape: torch.Size, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                val = rand(p.shape, 1.0)
            elif name.endswith("lm_head.weight"):
                val = rand(p.shape, 0.1)
                # Rows past the tokenizer's vocab are padding (as in real padded vocabs): keep their
                # logits near 0 so greedy decoding rarely picks an id the tokenizer cannot decode.
                val[TOKENIZER_VOCAB_SIZE:] *= 0.05
            elif name.endswith(_ROUTER_SUFFIXES) or name.endswith("mlp.router.bias"):
                val = rand(p.shape, 0.3)
            elif name.endswith("self_attn.sinks"):
                val = rand(p.shape, 1.0)
            elif p.ndim == 1 and "norm" in name:
                val = rand(p.shape, 0.1, mean=1.0)
            elif name.endswith("experts.gate_up_proj_bias"):  # gpt-oss [E, 2I], gate/up interleaved
                val = rand(p.shape, 0.1)
                val[:, ::16] += 8.0  # gate channels 0, 8, 16, ...: above the clamp (limit 7)
                val[:, 1::16] -= 8.0  # the matching up channels: below -limit
            else:  # other matrices, 3-D fused experts, and biases
                val = rand(p.shape, 0.1)
            p.copy_(val.to(p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(rand(b.shape, 0.3).to(b.dtype))


def build_tiny_model(
    arch: str,
    out_dir: Path,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    with_tokenizer: bool = True,
    **config_overrides: Any,
) -> Path:
    """Build a tiny random `arch` model, save it (safetensors, per-expert on-disk layout) to out_dir.

    The tokenizer from `build_tiny_tokenizer` is saved next to it when `with_tokenizer`. Returns out_dir.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomise_(model, seed)
    if dtype != torch.float32:
        keep_fp32 = ("e_score_correction_bias", "mlp.gate.weight") if arch == "deepseek_v3" else ()
        with torch.no_grad():
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if t.is_floating_point() and not name.endswith(keep_fp32) and "rotary_emb" not in name:
                    t.data = t.data.to(dtype)
        model.config.dtype = dtype
    model.eval()
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    if with_tokenizer:
        build_tiny_tokenizer(out_dir)
    return out_dir


def load_reference(path: Path, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """Load a saved model as the exact reference: eager experts (per-expert loop) and eager attention.

    Eager attention is the only implementation gpt-oss has for sinks (it has no SDPA path); for the
    others it removes SDPA-vs-eager rounding differences from reference comparisons.
    """
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, experts_implementation="eager", attn_implementation="eager"
    )
    return model.eval()


def safetensors_layout(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, dtype)} of every tensor in path/*.safetensors, as stored on disk."""
    from safetensors import safe_open

    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            for k in sf.keys():
                sl = sf.get_slice(k)
                out[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def hub_style_config(path: Path) -> Path:
    """Rewrite path/config.json with the key names real hub checkpoints use, where save_pretrained differs.

    Only Qwen3-MoE differs: transformers 5 saves `num_local_experts`, hub checkpoints say `num_experts`
    (both load, through the config's attribute_map). Returns path.
    """
    cfg_file = Path(path) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("model_type") == "qwen3_moe" and "num_local_experts" in cfg:
        cfg["num_experts"] = cfg.pop("num_local_experts")
        cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return Path(path)


def saved_config(path: Path) -> dict[str, Any]:
    """The config.json written by save_pretrained, as a dict."""
    return json.loads((Path(path) / "config.json").read_text())


__all__ = [
    "ARCHS",
    "CHAT_TEMPLATE",
    "EOS_TOKEN_ID",
    "PAD_TOKEN_ID",
    "SPECIAL_TOKENS",
    "TOKENIZER_VOCAB_SIZE",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "hub_style_config",
    "load_reference",
    "make_tiny_tokenizer",
    "safetensors_layout",
    "saved_config",
    "tiny_config",
]


def fresh_logits(engine: Any, ids: list[int]) -> torch.Tensor:
    """Next-token logits [V] of a fresh session prefilled with `ids` (the reference a restored
    or rolled-back context must equal)."""
    with engine.new_session() as s:
        return s.prefill(ids, last_only=True)[-1]
