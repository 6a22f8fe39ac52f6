"""OLMoE: full-width q/k RMSNorm before the head split, optional qkv clipping."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..spec import LayerSpec, ModelSpec, MoESpec
from .base import Adapter, common_spec_fields, gqa, head_dim_of, rope_spec


class OlmoeAdapter(Adapter):
    model_types = ("olmoe",)

    def make_spec(self, config: PretrainedConfig) -> ModelSpec:
        moe = MoESpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            routing="softmax_topk",
            norm_topk_prob=bool(config.norm_topk_prob),
        )
        bias = bool(config.attention_bias)
        attn = dict(qkv_bias=bias, o_bias=bias, qk_norm="full", clip_qkv=config.clip_qkv, sliding_window=None)
        layers = tuple(LayerSpec(gqa(config, i, **attn), moe) for i in range(config.num_hidden_layers))
        return ModelSpec(
            **common_spec_fields(config), layers=layers, rope=rope_spec(config, head_dim_of(config))
        )
