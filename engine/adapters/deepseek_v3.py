"""DeepSeek-V3: multi-head latent attention, sigmoid + group-limited routing with a score
correction bias, shared experts, and dense MLP layers before `first_k_dense_replace`."""

from __future__ import annotations

import math

from transformers import PretrainedConfig

from ..spec import AttentionSpec, LayerSpec, ModelSpec, MoESpec
from .base import Adapter, common_spec_fields, rope_spec


def _mla_scaling(config: PretrainedConfig) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale^2 when the rope is scaled (as the reference does)."""
    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    scaling = qk_head_dim**-0.5
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        factor = params.get("factor", 1.0)
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scaling = scaling * mscale * mscale
    return scaling


class DeepseekV3Adapter(Adapter):
    model_types = ("deepseek_v3",)
    shared_name = "shared_experts"

    def make_spec(self, config: PretrainedConfig) -> ModelSpec:
        attention = AttentionSpec(
            kind="mla",
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_attention_heads,
            head_dim=config.qk_nope_head_dim + config.qk_rope_head_dim,
            scaling=_mla_scaling(config),
            qkv_bias=bool(config.attention_bias),
            o_bias=bool(config.attention_bias),
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
        )
        moe = MoESpec(
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            routing="sigmoid_group_topk",
            norm_topk_prob=bool(config.norm_topk_prob),
            n_group=config.n_group or 1,
            topk_group=config.topk_group or 1,
            routed_scaling_factor=float(config.routed_scaling_factor),
            shared="plain" if config.n_shared_experts else "none",
            shared_intermediate_size=config.moe_intermediate_size * (config.n_shared_experts or 0),
        )
        first_dense = config.first_k_dense_replace or 0
        layers = tuple(
            LayerSpec(
                attention, moe if i >= first_dense else None, dense_intermediate_size=config.intermediate_size
            )
            for i in range(config.num_hidden_layers)
        )
        rope = rope_spec(config, config.qk_rope_head_dim, interleaved=bool(config.rope_interleave))
        return ModelSpec(**common_spec_fields(config), layers=layers, rope=rope)
