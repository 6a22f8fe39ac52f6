"""Tiny random MoE models written as GGUF files the way llama.cpp's convert_hf_to_gguf.py writes them.

`write_gguf(arch, folder, expert_type=...)` builds a tiny random Hugging Face model (`tiny_models`),
writes it as ``folder/model.gguf`` (metadata, llama.cpp tensor names, llama q/k permuted for rotary,
routed experts stacked ``[E, out, in]`` and quantized, the tiny tokenizer as ``tokenizer.ggml.*``) and
returns a `TinyGGUF` that also holds the *reference weights*: every GGUF tensor dequantized with
`gguf.quants.dequantize` and mapped back to its Hugging Face name and layout, saved as a checkpoint
folder (`TinyGGUF.reference_dir`) that transformers loads without any GGUF code.

DeepSeek-V3 (``deepseek2``): MLA metadata as the converter writes it, ``kv_b_proj`` split into
``attn_k_b`` (per head, transposed) and ``attn_v_b`` (``mla="split"``, the current converter) or kept
whole as ``attn_kv_b`` (``mla="fused"``, older converters: ``key_length`` = nope + rope, ``head_count_kv``
= heads), the router's correction bias as ``exp_probs_b.bias``; no q/k permutation.

Expert types: ``Q8_0``, ``Q4_0``, ``Q4_1``, ``MXFP4`` (quantized by gguf-py), ``Q4_K`` (gguf-py cannot
quantize it: random raw blocks with small fp16 d/dmin) and ``Q4_K+Q6_K`` (gate/up Q4_K, down Q6_K as
raw random blocks, like llama.cpp's Q4_K_M). K-quants need rows of 256 values: those models are built
with hidden size and expert width 256.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from tiny_models import build_tiny_tokenizer, make_tiny_tokenizer, tiny_config

GGUF_ARCH = {
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
    "gpt_oss": "gpt-oss",
    "deepseek_v3": "deepseek2",
}
EXPERT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q4_K+Q6_K", "MXFP4")
_K_QUANTS = ("Q4_K", "Q4_K+Q6_K")
_ARCH_IDS = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}


@dataclass
class TinyGGUF:
    """A written GGUF and what the tests compare against."""

    arch: str
    path: Path
    config: transformers.PretrainedConfig
    reference: dict[str, torch.Tensor] = field(default_factory=dict)  # HF name -> dequantized weights
    reference_dir: Path | None = None
    tensor_types: dict[str, Q] = field(default_factory=dict)  # GGUF name -> type written


def _permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF rotate-half q/k rows -> GGML's interleaved rotary order."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _raw_k_blocks(shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random raw K-quant blocks for a float tensor of `shape` (last dim a multiple of 256)."""
    rows = int(np.prod(shape[:-1]))
    n = rows * (shape[-1] // 256)
    if qtype == Q.Q4_K:
        d = (rng.uniform(0.5, 1.5, n) * 2e-4).astype(np.float16).view(np.uint8).reshape(n, 2)
        dmin = (rng.uniform(0.5, 1.5, n) * 1e-3).astype(np.float16).view(np.uint8).reshape(n, 2)
        scales = rng.integers(0, 256, (n, 12), dtype=np.uint8)
        qs = rng.integers(0, 256, (n, 128), dtype=np.uint8)
        blocks = np.concatenate([d, dmin, scales, qs], axis=1)
    else:  # Q6_K: ql[128], qh[64], scales int8[16], d fp16
        ql = rng.integers(0, 256, (n, 128), dtype=np.uint8)
        qh = rng.integers(0, 256, (n, 64), dtype=np.uint8)
        sc = rng.integers(-12, 13, (n, 16)).astype(np.int8).view(np.uint8)
        d = (rng.uniform(0.5, 1.5, n) * 3e-4).astype(np.float16).view(np.uint8).reshape(n, 2)
        blocks = np.concatenate([ql, qh, sc, d], axis=1)
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    return blocks.reshape(*shape[:-1], shape[-1] // 256 * type_size)


class _Writer:
    """Collects GGUF tensors and the reference value of each (dequantized from what was written)."""

    def __init__(self, writer: gguf.GGUFWriter, rng: np.random.Generator) -> None:
        self.w, self.rng, self.types = writer, rng, {}

    def add(self, name: str, value: np.ndarray, qtype: Q, *, raw: bool = False) -> np.ndarray:
        """Write `value` as `qtype` (raw: random K-quant blocks of value's shape); returns the
        dequantized values the file now holds."""
        value = np.ascontiguousarray(value, dtype=np.float32)
        if qtype == Q.F32:
            data = value
            self.w.add_tensor(name, data)
        elif qtype == Q.F16:
            data = value.astype(np.float16)
            self.w.add_tensor(name, data)
        else:
            data = _raw_k_blocks(value.shape, qtype, self.rng) if raw else gguf.quants.quantize(value, qtype)
            self.w.add_tensor(name, data, raw_dtype=qtype)
        self.types[name] = qtype
        return gguf.quants.dequantize(data, qtype).reshape(value.shape)


def _expert_types(expert_type: str) -> tuple[Q, Q, bool]:
    """(gate/up type, down type, raw K-quant blocks)."""
    if expert_type == "Q4_K+Q6_K":
        return Q.Q4_K, Q.Q6_K, True
    qtype = Q[expert_type]
    return qtype, qtype, qtype == Q.Q4_K


def tiny_gguf_config(arch: str, expert_type: str = "Q8_0", **overrides: Any) -> transformers.PretrainedConfig:
    """The tiny config of `arch` as a GGUF model has it (K-quants: hidden and expert width 256)."""
    extra: dict[str, Any] = {}
    if arch == "qwen2_moe":
        extra["mlp_only_layers"] = []  # llama.cpp's qwen2moe has no dense-MLP layers
    if arch == "deepseek_v3":  # rank, nope, v and rope all differ: a swapped or untransposed split fails
        extra.update(kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=12, qk_rope_head_dim=8)
    if expert_type in _K_QUANTS:
        width = "intermediate_size" if arch in ("mixtral", "olmoe", "gpt_oss") else "moe_intermediate_size"
        extra.update(hidden_size=256, num_hidden_layers=2, num_local_experts=4, **{width: 256})
        if arch in ("qwen2_moe", "qwen3_moe"):
            extra.pop("num_local_experts")
            extra["num_experts"] = 4
        if arch == "deepseek_v3":  # 8 routed experts kept: 4 groups of 2
            extra.pop("num_local_experts")
    return tiny_config(arch, **{**extra, **overrides})


def _add_metadata(
    w: gguf.GGUFWriter, arch: str, cfg: transformers.PretrainedConfig, mla: str = "split"
) -> None:
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1 if arch == "deepseek_v3" and mla != "fused" else cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    n_experts = (
        getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    )
    w.add_expert_count(n_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "head_dim", None) and arch in ("qwen3_moe", "gpt_oss"):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if arch == "mixtral":
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    elif arch == "qwen2_moe":
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    elif arch == "qwen3_moe":
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    elif arch == "olmoe":
        w.add_feed_forward_length(cfg.intermediate_size)
        if cfg.clip_qkv is not None:
            w.add_clamp_kqv(cfg.clip_qkv)
    elif arch == "gpt_oss":
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif arch == "deepseek_v3":
        _add_deepseek2_metadata(w, cfg, mla)


def _add_deepseek2_metadata(w: gguf.GGUFWriter, cfg: transformers.PretrainedConfig, mla: str) -> None:
    """What convert_hf_to_gguf.py's DeepseekV2Model adds (the split MLA form since llama.cpp's MLA change)."""
    rope, rank = cfg.rope_parameters, cfg.kv_lora_rank
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(rank)
    if mla == "fused":  # before the split: per-head sizes, one kv head per query head
        w.add_key_length(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.v_head_dim)
    else:
        w.add_key_length(rank + cfg.qk_rope_head_dim)
        w.add_value_length(rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _add_tokenizer(w: gguf.GGUFWriter, arch: str, vocab_size: int) -> None:
    tok = make_tiny_tokenizer()
    by_id = {i: t for t, i in tok.get_vocab().items()}
    special = set(tok.all_special_ids)
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
        else:  # llama.cpp pads the vocabulary to the model's size
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    import json

    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(
        {"qwen2_moe": "qwen2", "qwen3_moe": "qwen2", "deepseek_v3": "deepseek-v3"}.get(arch, "default")
    )
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tok.chat_template)


def write_gguf(
    arch: str, folder: Path, *, expert_type: str = "Q8_0", seed: int = 0, mla: str = "split", **overrides: Any
) -> TinyGGUF:
    """Write ``folder/model.gguf`` for a tiny random `arch` model and the reference checkpoint folder
    ``folder/reference`` (see module doc). Dense tensors: F32, the embedding F16, lm_head Q8_0 (deepseek2's
    attn_k_b / attn_v_b / attn_kv_b F16). `mla`: deepseek2's kv_b form, "split" or "fused"."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_gguf_config(arch, expert_type, **overrides)
    from tiny_models import _randomise_

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        _randomise_(model, seed)
    model.eval()
    rng = np.random.default_rng(seed)
    path = folder / "model.gguf"
    w = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    _add_metadata(w, arch, cfg, mla)
    _add_tokenizer(w, arch, cfg.vocab_size)
    out = _Writer(w, rng)
    ref = _write_tensors(out, arch, cfg, model.state_dict(), expert_type, mla)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    result = TinyGGUF(arch, path, cfg, ref, tensor_types=dict(out.types))
    with torch.no_grad():
        model.load_state_dict(ref, strict=True)
    result.reference_dir = folder / "reference"
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.save_pretrained(result.reference_dir)
    build_tiny_tokenizer(result.reference_dir)
    return result


def _write_tensors(
    out: _Writer,
    arch: str,
    cfg: transformers.PretrainedConfig,
    sd: dict[str, torch.Tensor],
    expert_type: str,
    mla: str = "split",
) -> dict[str, torch.Tensor]:
    names = gguf.get_tensor_name_map(_ARCH_IDS[GGUF_ARCH[arch]], cfg.num_hidden_layers)
    gate_type, down_type, raw = _expert_types(expert_type)
    ref: dict[str, torch.Tensor] = {}
    for hf, t in sd.items():
        x = t.float().numpy()
        parts = hf.split(".")
        layer = int(parts[2]) if parts[1] == "layers" else None
        if ".mlp.experts." in hf:
            ref[hf] = torch.from_numpy(
                _write_experts(out, arch, layer, parts[-1], x, gate_type, down_type, raw)
            )
            continue
        if hf.endswith("self_attn.sinks"):
            ref[hf] = torch.from_numpy(out.add(f"blk.{layer}.attn_sinks.weight", x, Q.F32))
            continue
        if hf.endswith("mlp.gate.e_score_correction_bias"):  # the converter renames it ...correction.bias
            ref[hf] = torch.from_numpy(out.add(f"blk.{layer}.exp_probs_b.bias", x, Q.F32))
            continue
        if hf.endswith("self_attn.kv_b_proj.weight"):
            ref[hf] = torch.from_numpy(_write_kv_b(out, cfg, layer, x, mla))
            continue
        base, suffix = hf.rsplit(".", 1)
        name = names.get_name(base)
        assert name is not None, hf
        name = f"{name}.{suffix}"
        qtype = Q.F16 if name == "token_embd.weight" else Q.Q8_0 if name == "output.weight" else Q.F32
        if hf.endswith("shared_expert_gate.weight"):  # llama.cpp stores [1, H] as [H]
            ref[hf] = torch.from_numpy(out.add(name, x.reshape(-1), qtype).reshape(x.shape))
            continue
        if arch == "mixtral" and name.endswith(("attn_q.weight", "attn_k.weight")):
            kv = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
            got = out.add(name, _permute(x, cfg.num_attention_heads, kv), qtype)
            ref[hf] = torch.from_numpy(_unpermute(got, cfg.num_attention_heads, kv).copy())
            continue
        ref[hf] = torch.from_numpy(out.add(name, x, qtype))
    return ref


def _write_kv_b(
    out: _Writer, cfg: transformers.PretrainedConfig, layer: int | None, x: np.ndarray, mla: str
) -> np.ndarray:
    """deepseek2's kv_b_proj ``[H * (nope + v), rank]``: whole (``attn_kv_b``), or per head split into the
    key rows transposed (``attn_k_b`` ``[H, rank, nope]``) and the value rows (``attn_v_b`` ``[H, v, rank]``);
    returns the value the file holds, back in the checkpoint's layout."""
    blk = f"blk.{layer}"
    if mla == "fused":
        return out.add(f"{blk}.attn_kv_b.weight", x, Q.F16)
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    per_head = x.reshape(heads, nope + v, x.shape[-1])
    k_b = out.add(f"{blk}.attn_k_b.weight", per_head[:, :nope].transpose(0, 2, 1), Q.F16)
    v_b = out.add(f"{blk}.attn_v_b.weight", per_head[:, nope:], Q.F16)
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(x.shape)


def _write_experts(
    out: _Writer,
    arch: str,
    layer: int | None,
    what: str,
    x: np.ndarray,
    gate_type: Q,
    down_type: Q,
    raw: bool,
) -> np.ndarray:
    """One fused HF expert tensor -> the GGUF expert tensors; returns its reference value."""
    blk = f"blk.{layer}"
    if arch == "gpt_oss":
        if what == "gate_up_proj":  # [E, H, 2I], gate/up interleaved -> [E, I, H] each
            t = x.transpose(0, 2, 1)
            g = out.add(f"{blk}.ffn_gate_exps.weight", t[:, ::2], gate_type, raw=raw)
            u = out.add(f"{blk}.ffn_up_exps.weight", t[:, 1::2], gate_type, raw=raw)
            both = np.empty_like(t)
            both[:, ::2], both[:, 1::2] = g, u
            return both.transpose(0, 2, 1).copy()
        if what == "gate_up_proj_bias":
            g = out.add(f"{blk}.ffn_gate_exps.bias", x[:, ::2], Q.F32)
            u = out.add(f"{blk}.ffn_up_exps.bias", x[:, 1::2], Q.F32)
            both = np.empty_like(x)
            both[:, ::2], both[:, 1::2] = g, u
            return both
        if what == "down_proj":  # [E, I, H] -> [E, H, I]
            d = out.add(f"{blk}.ffn_down_exps.weight", x.transpose(0, 2, 1), down_type, raw=raw)
            return d.transpose(0, 2, 1).copy()
        assert what == "down_proj_bias"
        return out.add(f"{blk}.ffn_down_exps.bias", x, Q.F32)
    if what == "gate_up_proj":  # [E, 2I, H], gate rows first
        i = x.shape[1] // 2
        g = out.add(f"{blk}.ffn_gate_exps.weight", x[:, :i], gate_type, raw=raw)
        u = out.add(f"{blk}.ffn_up_exps.weight", x[:, i:], gate_type, raw=raw)
        return np.concatenate([g, u], axis=1)
    assert what == "down_proj", what
    return out.add(f"{blk}.ffn_down_exps.weight", x, down_type, raw=raw)


def load_gguf_reference(tiny: TinyGGUF) -> transformers.PreTrainedModel:
    """transformers' own GGUF loader on the file (eager attention and experts), for the archs it
    can load; the fields its GGUF config mapping lacks (expert widths) are passed as overrides."""
    cfg = tiny.config
    extra: dict[str, Any] = {}
    if tiny.arch in ("qwen2_moe", "qwen3_moe"):
        extra["moe_intermediate_size"] = cfg.moe_intermediate_size
    if tiny.arch == "qwen2_moe":
        extra["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny.path.parent),
        gguf_file=tiny.path.name,
        dtype=torch.float32,
        experts_implementation="eager",
        attn_implementation="eager",
        **extra,
    )
    return model.eval()


def load_folder_reference(tiny: TinyGGUF) -> transformers.PreTrainedModel:
    """transformers on the reference checkpoint folder (the GGUF's tensors dequantized by gguf-py)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny.reference_dir, dtype=torch.float32, experts_implementation="eager", attn_implementation="eager"
    )
    return model.eval()
