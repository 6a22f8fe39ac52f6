"""The decoder-only MoE transformer, built from a ModelSpec.

Weights are created on the meta device and assigned from the checkpoint (no double allocation);
routed experts live outside the module tree, behind an ExpertProvider.
Letters: T new tokens, H hidden, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import GQAAttention, MLAAttention
from .experts import ExpertProvider
from .kv import StreamSpec
from .layers import RMSNorm, StepContext
from .moe import DenseMLP, MoEBlock
from .spec import LayerSpec, ModelSpec


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: LayerSpec, index: int) -> None:
        super().__init__()
        h, eps, fp32w = spec.hidden_size, spec.rms_norm_eps, spec.norm_weight_in_fp32
        self.input_layernorm = RMSNorm(h, eps, weight_in_fp32=fp32w)
        self.post_attention_layernorm = RMSNorm(h, eps, weight_in_fp32=fp32w)
        if layer.attention.kind == "mla":
            self.self_attn: GQAAttention | MLAAttention = MLAAttention(
                layer.attention, h, eps, index, spec.rope.interleaved
            )
        else:
            self.self_attn = GQAAttention(layer.attention, h, eps, index)
        if layer.moe is not None:
            self.mlp: MoEBlock | DenseMLP = MoEBlock(layer.moe, h, index)
        else:
            self.mlp = DenseMLP(h, layer.dense_intermediate_size)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoETransformer(nn.Module):
    """embed -> layers -> norm -> lm_head. One sequence at a time; KV through StepContext."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, device="meta").requires_grad_(
            False
        )
        self.layers = nn.ModuleList(DecoderLayer(spec, layer, i) for i, layer in enumerate(spec.layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, weight_in_fp32=spec.norm_weight_in_fp32)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, device="meta")
            self.lm_head.requires_grad_(False)

    def attach_experts(self, provider: ExpertProvider) -> None:
        for layer in self.layers:
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.provider = provider

    def fp32_parameter_names(self) -> set[str]:
        """Parameters kept in fp32 whatever the model dtype (DeepSeek's router, as the reference)."""
        names = set()
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, MoEBlock) and layer.mlp.spec.routing == "sigmoid_group_topk":
                router = layer.mlp.router
                prefix = f"layers.{i}.mlp.router."
                names |= {prefix + n for n, _ in [*router.named_parameters(), *router.named_buffers()]}
        return names

    def kv_streams(self) -> list[tuple[StreamSpec, ...]]:
        return [layer.self_attn.kv_streams() for layer in self.layers]

    def head_weight(self) -> torch.Tensor:
        """The float output-head weight [V, H] (the embedding when tied; not after int8 quantization)."""
        return self.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight

    def forward(self, tokens: torch.Tensor, ctx: StepContext, *, last_only: bool = False) -> torch.Tensor:
        """tokens [T] -> logits [T, V] (or [1, V] with last_only)."""
        x = self.embed_tokens(tokens)  # [T, H]
        for layer in self.layers:
            x = layer(x, ctx)
        if last_only:
            x = x[-1:]
        h = self.norm(x)
        # `lm_head` is an nn.Linear (untied), an int8.Int8Linear (`quantize_dense`, tied or not), or
        # absent (tied float head); nn.Linear and F.linear with the same weight are the same op.
        head = getattr(self, "lm_head", None)
        return head(h) if head is not None else F.linear(h, self.embed_tokens.weight)
