"""Qwen2-MoE (qkv bias, gated shared expert) and Qwen3-MoE (per-head q/k RMSNorm)."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..spec import LayerSpec, ModelSpec, MoESpec
from .base import Adapter, common_spec_fields, gqa, head_dim_of, rope_spec


class QwenMoeAdapter(Adapter):
    model_types = ("qwen2_moe", "qwen3_moe")

    def make_spec(self, config: PretrainedConfig) -> ModelSpec:
        qwen2 = config.model_type == "qwen2_moe"
        moe = MoESpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            routing="softmax_topk",
            norm_topk_prob=bool(config.norm_topk_prob),
            shared="gated" if qwen2 and config.shared_expert_intermediate_size else "none",
            shared_intermediate_size=config.shared_expert_intermediate_size if qwen2 else 0,
        )
        if qwen2:
            bias = dict(qkv_bias=bool(config.qkv_bias), o_bias=False)
        else:
            bias = dict(
                qkv_bias=bool(config.attention_bias), o_bias=bool(config.attention_bias), qk_norm="per_head"
            )
        sparse_step = getattr(config, "decoder_sparse_step", 1) or 1
        mlp_only = set(getattr(config, "mlp_only_layers", None) or [])
        layers = []
        for i in range(config.num_hidden_layers):
            sparse = i not in mlp_only and config.num_experts > 0 and (i + 1) % sparse_step == 0
            layers.append(
                LayerSpec(
                    gqa(config, i, **bias),
                    moe if sparse else None,
                    dense_intermediate_size=config.intermediate_size,
                )
            )
        return ModelSpec(
            **common_spec_fields(config), layers=tuple(layers), rope=rope_spec(config, head_dim_of(config))
        )
