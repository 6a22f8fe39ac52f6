"""Architecture-neutral description of a MoE transformer, read from a Hugging Face config.

The adapters (`engine/adapters/`) fill a `ModelSpec`; the model code reads nothing else, so a new
architecture is a new adapter, not a fork of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

RoutingKind = Literal["softmax_topk", "topk_softmax", "sigmoid_group_topk"]
Activation = Literal["silu", "gpt_oss_swiglu"]


@dataclass(frozen=True)
class AttentionSpec:
    """Attention of one layer. kind "gqa": grouped-query; kind "mla": DeepSeek multi-head latent."""

    kind: Literal["gqa", "mla"]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: Literal["none", "per_head", "full"] = "none"
    clip_qkv: float | None = None
    sinks: bool = False
    sliding_window: int | None = None
    # MLA only
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0


@dataclass(frozen=True)
class MoESpec:
    """Routed experts of one MoE layer (and its shared experts, if any)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    routing: RoutingKind
    norm_topk_prob: bool = False
    router_bias: bool = False
    activation: Activation = "silu"
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # sigmoid_group_topk (DeepSeek-V3)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # shared experts: "none", "gated" (Qwen2-MoE: sigmoid gate), "plain" (DeepSeek)
    shared: Literal["none", "gated", "plain"] = "none"
    shared_intermediate_size: int = 0


@dataclass(frozen=True)
class LayerSpec:
    attention: AttentionSpec
    moe: MoESpec | None  # None: a dense MLP layer
    dense_intermediate_size: int = 0


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding: inverse frequencies [rot_dim/2], cos/sin scale, pair layout."""

    inv_freq: torch.Tensor
    attention_scaling: float = 1.0
    interleaved: bool = False  # DeepSeek: pairs (x0, x1), (x2, x3) instead of halves


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    layers: tuple[LayerSpec, ...]
    rope: RopeSpec
    tie_word_embeddings: bool = False
    # gpt-oss multiplies the norm weight before casting back to the activation dtype
    norm_weight_in_fp32: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def moe_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.moe is not None]
