"""GGUF architecture ``deepseek2`` (DeepSeek-V3 / V3.1 / R1, Kimi-K2; V2 only with sigmoid routing)
-> the engine's ``deepseek_v3`` model, as llama.cpp's convert_hf_to_gguf.py (DeepseekV2Model) writes it.

Metadata (``deepseek2.*``) -> config.json fields:

- ``attention.q_lora_rank`` (absent when the file has ``attn_q``: V2-Lite), ``attention.kv_lora_rank``,
  ``rope.dimension_count`` = qk_rope_head_dim. The per-head sizes are read off the tensors (the
  converter's ``key_length`` / ``value_length`` changed meaning when MLA was split: kv_lora_rank + rope
  and kv_lora_rank in newer files, nope + rope and v_head_dim in older ones); ``key_length_mla`` /
  ``value_length_mla`` (newer files) must agree with them. ``head_count_kv`` (1 in newer files: MLA as
  MQA) is ignored: DeepSeek has as many key/value heads as query heads.
- ``leading_dense_block_count`` = first_k_dense_replace, ``feed_forward_length`` = the dense layers'
  width, ``expert_feed_forward_length`` = moe_intermediate_size, ``expert_count`` /
  ``expert_used_count`` / ``expert_shared_count``, ``expert_weights_scale`` = routed_scaling_factor
  (1.0 when absent), ``expert_weights_norm`` = norm_topk_prob (written only when true),
  ``expert_group_count`` / ``expert_group_used_count`` = n_group / topk_group (1 when absent: no group
  limit, as llama.cpp routes then). ``expert_gating_func`` must be sigmoid (2): llama.cpp reads a missing
  key as softmax (DeepSeek-V2 / V2.5 routing), which the engine does not run.
- YaRN: ``rope.scaling.*`` as for every arch, and ``rope.scaling.yarn_log_multiplier`` = 0.1 *
  mscale_all_dim (deepseek2's own convention), mapped back to mscale = mscale_all_dim (DeepSeek's
  configs have them equal; llama.cpp's deepseek2 graph assumes so).
- rotary: llama.cpp runs deepseek2 with GGML's "normal" rope (adjacent pairs) and the converter does not
  permute q/k, so the weights are the checkpoint's own with ``rope_interleave = True``.
- ``nextn_predict_layers`` (multi-token-prediction blocks, when a converter keeps them) are not layers
  of the model: ``num_hidden_layers = block_count - nextn_predict_layers``.

Tensors: ``attn_q_a``, ``attn_q_a_norm``, ``attn_q_b`` (or ``attn_q``), ``attn_kv_a_mqa``,
``attn_kv_a_norm``, ``attn_output``; ``exp_probs_b.bias`` = the router's e_score_correction_bias;
``ffn_*_shexp`` = the shared experts (n_shared_experts of them fused, as in the checkpoint);
``ffn_*_exps`` = routed experts; ``ffn_gate/up/down`` in the leading dense layers. ``kv_b_proj`` is
stored either whole (``attn_kv_b``, older converters) or, as the current converter writes it, split
per head for MLA's weight absorption: ``attn_k_b`` = the key half transposed, ``[H, kv_lora_rank,
nope]``, and ``attn_v_b`` = the value half, ``[H, v_head_dim, kv_lora_rank]``. `kv_b` undoes the split
exactly (a transpose and a concatenation of the dequantized values); when a file has both forms the
split one is used, as llama.cpp does.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...errors import CheckpointError, UnsupportedModelError
from .reader import GGUFSource

SIGMOID = 2  # gguf.ExpertGatingFuncType.SIGMOID
SOFTMAX = 1


def malformed(src: GGUFSource, what: str) -> CheckpointError:
    """The one-line error for deepseek2 metadata that contradicts itself or the tensors."""
    return CheckpointError(f"{src.path}: malformed deepseek2 GGUF metadata: {what}")


def _k(src: GGUFSource, name: str, default: Any = None) -> Any:
    return src.get("deepseek2." + name, default)


def _int(src: GGUFSource, name: str, default: int | None = None) -> int:
    value = _k(src, name, default)
    if value is None:
        raise malformed(src, f"'deepseek2.{name}' is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise malformed(src, f"'deepseek2.{name}' is {value!r}, expected a non-negative integer")
    return value


def _rows(src: GGUFSource, name: str, dim: int = 0) -> int | None:
    t = src.tensors.get(name)
    return None if t is None else t.shape[dim]


def _per_head(src: GGUFSource, total: int | None, heads: int, what: str) -> int | None:
    if total is None:
        return None
    if total % heads:
        raise malformed(src, f"{what} has {total} rows, not a multiple of head_count {heads}")
    return total // heads


def _agree(src: GGUFSource, key: str, value: int) -> None:
    stated = _k(src, key)
    if stated is not None and stated != value:
        raise malformed(src, f"'deepseek2.{key}' is {stated}, the tensors say {value}")


def config_fields(src: GGUFSource) -> dict[str, Any]:
    """The deepseek_v3 config.json fields of `src` (beyond `config._common`'s); UnsupportedModelError
    for a model the engine cannot run as DeepSeek-V3, CheckpointError for malformed metadata."""
    heads = _int(src, "attention.head_count")
    if heads == 0:
        raise malformed(src, "'deepseek2.attention.head_count' is 0")
    n_experts = _int(src, "expert_count", 0)
    if n_experts == 0:
        raise UnsupportedModelError(
            f"{src.path}: a deepseek2 GGUF without routed experts; "
            "the engine runs Mixture-of-Experts models only"
        )
    gating = _k(src, "expert_gating_func", SOFTMAX)
    if gating != SIGMOID:
        raise UnsupportedModelError(
            f"{src.path}: deepseek2 GGUF with expert_gating_func {gating} (softmax routing: "
            "DeepSeek-V2/V2.5); the engine runs DeepSeek-V3's sigmoid routing (expert_gating_func 2) only"
        )
    layers = _int(src, "block_count") - _int(src, "nextn_predict_layers", 0)
    first_dense = _int(src, "leading_dense_block_count", 0)
    if not 0 <= first_dense < layers:
        raise malformed(src, f"leading_dense_block_count {first_dense} leaves no MoE layer of {layers}")
    rope = _int(src, "rope.dimension_count")
    kv_rank = _int(src, "attention.kv_lora_rank")
    if kv_rank == 0:
        raise malformed(src, "'deepseek2.attention.kv_lora_rank' is 0")
    kv_a = _rows(src, "blk.0.attn_kv_a_mqa.weight")
    if kv_a is not None and kv_a != kv_rank + rope:
        raise malformed(
            src, f"attn_kv_a_mqa has {kv_a} rows, kv_lora_rank + rope.dimension_count = {kv_rank + rope}"
        )
    q_rank = _rows(src, "blk.0.attn_q_a.weight")  # None without q compression (V2-Lite)
    if q_rank is not None:
        _agree(src, "attention.q_lora_rank", q_rank)
    q_name = "blk.0.attn_q_b.weight" if q_rank is not None else "blk.0.attn_q.weight"
    qk_head = _per_head(src, _rows(src, q_name), heads, q_name)
    if qk_head is None:
        qk_head = _int(src, "attention.key_length_mla", _k(src, "attention.key_length"))
    nope = qk_head - rope
    if nope <= 0:
        raise malformed(src, f"query head size {qk_head} leaves no room beside rope.dimension_count {rope}")
    _agree(src, "attention.key_length_mla", qk_head)
    v_head = _v_head_dim(src, heads, kv_rank, nope)
    _agree(src, "attention.value_length_mla", v_head)
    moe_width = _expert_width(src, first_dense)
    dense_width = _rows(src, "blk.0.ffn_gate.weight") if first_dense else None
    n_shared = _int(src, "expert_shared_count", 0)
    shared = _rows(src, f"blk.{first_dense}.ffn_up_shexp.weight")
    if (shared or 0) != moe_width * n_shared:
        raise malformed(
            src, f"{n_shared} shared expert(s) of width {moe_width}, but ffn_up_shexp has {shared or 0} rows"
        )
    n_group = _int(src, "expert_group_count", 1) or 1
    topk_group = _int(src, "expert_group_used_count", 1) or 1
    if n_experts % n_group or topk_group > n_group:
        raise malformed(src, f"{n_experts} experts in {n_group} groups, {topk_group} of them used")
    return dict(
        num_hidden_layers=layers,
        num_key_value_heads=heads,
        q_lora_rank=q_rank,
        kv_lora_rank=kv_rank,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=nope,
        v_head_dim=v_head,
        intermediate_size=_k(src, "feed_forward_length", dense_width or moe_width),
        moe_intermediate_size=moe_width,
        n_routed_experts=n_experts,
        n_shared_experts=n_shared,
        first_k_dense_replace=first_dense,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(_k(src, "expert_weights_scale", 1.0)),
        norm_topk_prob=bool(_k(src, "expert_weights_norm", False)),
        rope_interleave=True,
        attention_bias=False,
        rope_parameters=_rope(src),
    )


def _v_head_dim(src: GGUFSource, heads: int, kv_rank: int, nope: int) -> int:
    v_b = src.tensors.get("blk.0.attn_v_b.weight")
    if v_b is not None:
        per_head = math.prod(v_b.shape) // heads
        if per_head % kv_rank or per_head * heads != math.prod(v_b.shape):
            raise malformed(src, f"attn_v_b {list(v_b.shape)} is not [{heads}, v_head_dim, {kv_rank}]")
        return per_head // kv_rank
    kv_b = _per_head(src, _rows(src, "blk.0.attn_kv_b.weight"), heads, "attn_kv_b")
    if kv_b is not None:
        return kv_b - nope
    return _int(src, "attention.value_length_mla", _k(src, "attention.value_length"))


def _expert_width(src: GGUFSource, layer: int) -> int:
    for name in ("ffn_gate_exps", "ffn_up_exps"):
        if (rows := _rows(src, f"blk.{layer}.{name}.weight", 1)) is not None:
            _agree(src, "expert_feed_forward_length", rows)
            return rows
    return _int(src, "expert_feed_forward_length")


def _rope(src: GGUFSource) -> dict[str, Any]:
    theta = float(_k(src, "rope.freq_base", 10000.0))
    kind = _k(src, "rope.scaling.type")
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "yarn":
        raise UnsupportedModelError(
            f"{src.path}: deepseek2 GGUF with rope scaling '{kind}' (only YaRN is supported)"
        )
    rope: dict[str, Any] = {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": float(_k(src, "rope.scaling.factor", 1.0)),
        "original_max_position_embeddings": _int(src, "rope.scaling.original_context_length"),
        "beta_fast": float(_k(src, "rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(_k(src, "rope.scaling.yarn_beta_slow", 1.0)),
    }
    log_mul = _k(src, "rope.scaling.yarn_log_multiplier")
    if log_mul:
        mscale = round(float(log_mul) / 0.1, 6)  # stored as float32: 0.1 * 1.0 -> 0.1000000015
        rope.update(mscale=mscale, mscale_all_dim=mscale)
    attn = _k(src, "rope.scaling.yarn_attn_factor")
    if attn is not None:
        rope["attention_factor"] = float(attn)
    elif not log_mul:
        rope["attention_factor"] = 1.0  # no log multiplier: llama.cpp scales neither cos/sin nor the logits
    return rope


def has_split_kv_b(src: GGUFSource, layer: int) -> bool:
    return src.has(f"blk.{layer}.attn_k_b.weight") and src.has(f"blk.{layer}.attn_v_b.weight")


def kv_b(src: GGUFSource, layer: int, config: dict[str, Any]) -> torch.Tensor:
    """``kv_b_proj.weight`` ``[H * (nope + v), kv_lora_rank]`` of `layer`, rebuilt from the split
    ``attn_k_b`` (``[H, rank, nope]``, the key rows transposed) and ``attn_v_b`` (``[H, v, rank]``)."""
    heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    k_b = src.float_tensor(f"blk.{layer}.attn_k_b.weight")
    v_b = src.float_tensor(f"blk.{layer}.attn_v_b.weight")
    for t, shape, name in ((k_b, (heads, rank, nope), "attn_k_b"), (v_b, (heads, v, rank), "attn_v_b")):
        if t.numel() != math.prod(shape):
            raise CheckpointError(
                f"{src.path}: tensor 'blk.{layer}.{name}.weight' has shape {list(t.shape)}, "
                f"the model needs {list(shape)}"
            )
    k_b = k_b.reshape(heads, rank, nope).transpose(1, 2)
    if k_b.dtype != v_b.dtype:  # one BF16, one not: widen both (exact)
        k_b, v_b = k_b.float(), v_b.float()
    both = torch.cat([k_b, v_b.reshape(heads, v, rank)], dim=1)
    return both.reshape(heads * (nope + v), rank).contiguous()
