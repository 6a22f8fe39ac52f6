"""Mixtral: GQA + softmax top-k routing with renormalised weights; experts w1 (gate), w3 (up), w2."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..spec import LayerSpec, ModelSpec, MoESpec
from .base import Adapter, common_spec_fields, gqa, head_dim_of, rope_spec


class MixtralAdapter(Adapter):
    model_types = ("mixtral",)
    moe_prefix = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")

    def make_spec(self, config: PretrainedConfig) -> ModelSpec:
        moe = MoESpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            routing="softmax_topk",
            norm_topk_prob=True,
        )
        layers = tuple(LayerSpec(gqa(config, i), moe) for i in range(config.num_hidden_layers))
        return ModelSpec(
            **common_spec_fields(config), layers=layers, rope=rope_spec(config, head_dim_of(config))
        )
