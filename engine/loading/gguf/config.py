"""A GGUF file's metadata -> the Hugging Face config of the model it holds (one function per arch).

llama.cpp writes a model's hyper-parameters as ``{arch}.*`` keys (``qwen3moe.expert_count``, ...).
Sizes the metadata may omit are read off the tensor shapes, which are the truth the weights must
fit. The result is a full config.json dict (`CONFIG_MAPPING[model_type](...).to_dict()`), so the FTW
file is self-contained like any HF-folder conversion.

=================  ===========  ==========================================================
GGUF architecture  model_type   notes
=================  ===========  ==========================================================
qwen3moe           qwen3_moe    llama.cpp always renormalises the top-k weights
qwen2moe           qwen2_moe    gated shared expert; no renormalisation; no dense layers
llama + experts    mixtral      a "llama" file with ``expert_count > 0``; q/k un-permuted
olmoe              olmoe        ``attention.clamp_kqv`` is clip_qkv
gpt-oss            gpt_oss      YaRN from ``rope.scaling.*``; sliding window on even layers
deepseek2          deepseek_v3  MLA, sigmoid group-limited routing: see `deepseek2`
=================  ===========  ==========================================================
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ...errors import CheckpointError, UnsupportedModelError
from ...spec_checks import ROPE_RULES, RULES, check_config, check_layer_count, check_raw_config, check_value
from .deepseek2 import config_fields as _deepseek_v3
from .reader import GGUFSource

#: GGUF architecture -> engine model_type (llama only with experts)
ARCHS = {
    "qwen3moe": "qwen3_moe",
    "qwen2moe": "qwen2_moe",
    "llama": "mixtral",
    "olmoe": "olmoe",
    "gpt-oss": "gpt_oss",
    "deepseek2": "deepseek_v3",
}


def model_type_of(src: GGUFSource) -> str:
    """The engine model_type for `src`; UnsupportedModelError naming the file otherwise."""
    model_type = ARCHS.get(src.arch)
    if model_type is None:
        raise UnsupportedModelError(
            f"{src.path}: GGUF architecture '{src.arch}' is not supported; supported: "
            f"{', '.join(sorted(ARCHS))} (llama with experts = Mixtral)"
        )
    if src.arch == "llama" and not (src.get("{arch}.expert_count") or 0):
        raise UnsupportedModelError(
            f"{src.path}: a dense llama GGUF (no experts); the engine runs Mixture-of-Experts models only"
        )
    return model_type


def hf_config(src: GGUFSource) -> dict[str, Any]:
    """The config.json dict of the model in `src` (UnsupportedModelError for other architectures).

    The hyper-parameters are checked before anything is computed from them (`spec_checks`, under
    their GGUF key names), and the layer count against the ``blk.N.*`` tensors: CheckpointError
    naming the file, the key and the value."""
    from transformers import CONFIG_MAPPING

    model_type = model_type_of(src)
    check_metadata(src)
    fields = _BUILDERS[model_type](src)
    fields = {**_common(src), **fields}
    where = str(src.path)
    head_dim = "rope.dimension_count" if src.arch == "llama" else "attention.key_length"
    names = {hf: f"{src.arch}.{key}" for hf, key in {**_NAMES, "head_dim": head_dim}.items()}
    check_raw_config({"model_type": model_type, **fields}, where, names)
    try:
        config = CONFIG_MAPPING[model_type](**fields)
    except Exception as e:  # noqa: BLE001 - strict-dataclass, Value, Type errors: all mean "refused"
        why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise CheckpointError(
            f"{where}: the GGUF metadata gives a config transformers refuses ({why})"
        ) from None
    check_config(config, where, names)
    return config.to_dict()


#: GGUF metadata key (after ``{arch}.``) -> the config.json key whose rule it follows
_METADATA_RULES = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.value_length": "head_dim",
    "attention.key_length_mla": "head_dim",
    "attention.value_length_mla": "head_dim",
    "rope.dimension_count": "qk_rope_head_dim",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
    "feed_forward_length": "intermediate_size",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_shared_count": "n_shared_experts",
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
    "leading_dense_block_count": "first_k_dense_replace",
    "nextn_predict_layers": "num_nextn_predict_layers",
    "attention.q_lora_rank": "q_lora_rank",
    "attention.kv_lora_rank": "kv_lora_rank",
    "attention.sliding_window": "sliding_window",
    "attention.clamp_kqv": "clip_qkv",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_parameters.rope_theta",
    "rope.scaling.factor": "rope_parameters.factor",
    "rope.scaling.original_context_length": "rope_parameters.original_max_position_embeddings",
    "rope.scaling.yarn_beta_fast": "rope_parameters.beta_fast",
    "rope.scaling.yarn_beta_slow": "rope_parameters.beta_slow",
    "rope.scaling.yarn_log_multiplier": "rope_parameters.mscale",
    "expert_weights_scale": "routed_scaling_factor",
    "expert_weights_norm": "norm_topk_prob",
}
#: config.json key -> the GGUF metadata key it comes from, to name it in errors on relations
_NAMES = {
    "num_hidden_layers": "block_count",
    "hidden_size": "embedding_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "max_position_embeddings": "context_length",
    "num_experts": "expert_count",
    "num_local_experts": "expert_count",
    "n_routed_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "n_group": "expert_group_count",
    "topk_group": "expert_group_used_count",
    "first_k_dense_replace": "leading_dense_block_count",
    "qk_rope_head_dim": "rope.dimension_count",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "rope_parameters.rope_theta": "rope.freq_base",
}
#: metadata every supported architecture must state (the rest have defaults or come from tensors)
_REQUIRED = ("block_count", "embedding_length", "attention.head_count", "expert_count", "expert_used_count")
_BLOCK = re.compile(r"blk\.(\d+)\.")


def check_metadata(src: GGUFSource) -> None:
    """Every hyper-parameter key of `src`'s metadata against its rule (`spec_checks.RULES`), and
    ``block_count`` against the ``blk.N.*`` tensors, before any arithmetic on them."""
    where = str(src.path)
    for key in _REQUIRED:
        if src.get("{arch}." + key) is None:
            raise CheckpointError(f"{where}: GGUF metadata has no '{src.arch}.{key}'")
    for key, hf in _METADATA_RULES.items():
        value = src.get("{arch}." + key)
        if value is not None:
            rope, _, name = hf.rpartition(".")
            check_value(where, f"{src.arch}.{key}", value, (ROPE_RULES if rope else RULES)[name])
    found = (int(m[1]) for name in src.tensors if (m := _BLOCK.match(name)))
    check_layer_count(
        where, f"{src.arch}.block_count", src.get("{arch}.block_count"), found, "blk.N.* tensors"
    )


def eos_ids(src: GGUFSource) -> list[int]:
    """The token ids that end a turn: tokenizer.ggml's eos, then eot and eom (llama.cpp's
    end-of-generation set), each once."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = src.get(key)
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return ids


def _k(src: GGUFSource, name: str, default: Any = None) -> Any:
    return src.get("{arch}." + name, default)


def _rows(src: GGUFSource, name: str, dim: int) -> int | None:
    t = src.tensors.get(name)
    return None if t is None else t.shape[dim]


def _common(src: GGUFSource) -> dict[str, Any]:
    hidden = _k(src, "embedding_length")
    heads = _k(src, "attention.head_count")
    vocab = (
        src.array_length("tokenizer.ggml.tokens")
        or _k(src, "vocab_size")
        or _rows(src, "token_embd.weight", 0)
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(_k(src, "rope.freq_base", 10000.0))}
    if _k(src, "rope.scaling.type") == "yarn":
        rope = {
            "rope_type": "yarn",
            "rope_theta": rope["rope_theta"],
            "factor": float(_k(src, "rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(_k(src, "rope.scaling.original_context_length", 4096)),
            "beta_fast": float(_k(src, "rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(_k(src, "rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False,
        }
    elif _k(src, "rope.scaling.type") == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(_k(src, "rope.scaling.factor", 1.0))}
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=_k(src, "block_count"),
        num_attention_heads=heads,
        num_key_value_heads=_k(src, "attention.head_count_kv", heads),
        max_position_embeddings=_k(src, "context_length", 4096),
        rms_norm_eps=float(_k(src, "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in src.tensors,
        eos_token_id=src.get("tokenizer.ggml.eos_token_id"),
        bos_token_id=src.get("tokenizer.ggml.bos_token_id"),
        pad_token_id=src.get("tokenizer.ggml.padding_token_id"),
        num_experts_per_tok=_k(src, "expert_used_count"),
        dtype="float32",
    )


def _expert_width(src: GGUFSource) -> int | None:
    for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"):
        if (rows := _rows(src, name, 1)) is not None:
            return rows
    rows = _rows(src, "blk.0.ffn_gate_up_exps.weight", 1)
    return rows // 2 if rows is not None else _k(src, "expert_feed_forward_length")


def _qwen3_moe(src: GGUFSource) -> dict[str, Any]:
    hidden, heads = _k(src, "embedding_length"), _k(src, "attention.head_count")
    return dict(
        head_dim=_k(src, "attention.key_length", hidden // heads),
        intermediate_size=_k(src, "feed_forward_length", _expert_width(src)),
        moe_intermediate_size=_expert_width(src),
        num_experts=_k(src, "expert_count"),
        norm_topk_prob=bool(_k(src, "expert_weights_norm", True)),
        decoder_sparse_step=1,
        mlp_only_layers=[],
        attention_bias=src.has("blk.0.attn_q.bias"),
        use_sliding_window=False,
    )


def _qwen2_moe(src: GGUFSource) -> dict[str, Any]:
    shared = _rows(src, "blk.0.ffn_up_shexp.weight", 0) or _k(src, "expert_shared_feed_forward_length", 0)
    return dict(
        intermediate_size=_k(src, "feed_forward_length", _expert_width(src)),
        moe_intermediate_size=_expert_width(src),
        shared_expert_intermediate_size=shared,
        num_experts=_k(src, "expert_count"),
        norm_topk_prob=bool(_k(src, "expert_weights_norm", False)),
        qkv_bias=src.has("blk.0.attn_q.bias"),
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
    )


def _mixtral(src: GGUFSource) -> dict[str, Any]:
    hidden, heads = _k(src, "embedding_length"), _k(src, "attention.head_count")
    return dict(
        head_dim=_k(src, "rope.dimension_count", hidden // heads),
        intermediate_size=_expert_width(src),
        num_local_experts=_k(src, "expert_count"),
        sliding_window=_k(src, "attention.sliding_window"),
    )


def _olmoe(src: GGUFSource) -> dict[str, Any]:
    return dict(
        intermediate_size=_expert_width(src),
        num_experts=_k(src, "expert_count"),
        norm_topk_prob=bool(_k(src, "expert_weights_norm", False)),
        clip_qkv=_k(src, "attention.clamp_kqv"),
    )


def _gpt_oss(src: GGUFSource) -> dict[str, Any]:
    hidden, heads = _k(src, "embedding_length"), _k(src, "attention.head_count")
    n = _k(src, "block_count")
    return dict(
        head_dim=_k(src, "attention.key_length", hidden // heads),
        intermediate_size=_expert_width(src),
        num_local_experts=_k(src, "expert_count"),
        sliding_window=_k(src, "attention.sliding_window", 128),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        attention_bias=src.has("blk.0.attn_q.bias"),
    )


_BUILDERS: dict[str, Callable[[GGUFSource], dict[str, Any]]] = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
}
