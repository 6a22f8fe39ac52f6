"""The decoder-only MoE transformer, built from a ModelSpec.

Weights are created on the meta device and assigned from the checkpoint (no double allocation);
routed experts live outside the module tree, behind an ExpertStore.
Letters: T new tokens, H hidden, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..spec import LayerSpec, ModelSpec
from .attention import GQAAttention, MLAAttention
from .experts import ExpertStore
from .kv import StreamSpec
from .layers import RMSNorm, StepContext, linear
from .moe import DenseMLP, MoEBlock


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
        # Norms and the MLP block are called through .forward: nn.Module's call machinery costs
        # ~2-5 us a call here, and nothing hooks them (attention and the router keep it: the
        # tiered provider times attention by hooks, tests hook routers).
        # The residual add and the norm after it are one kernel on CUDA (`RMSNorm.add_forward`).
        x, h = self.post_attention_layernorm.add_forward(
            x, self.self_attn(self.input_layernorm.forward(x), ctx)
        )
        return x + self.mlp.forward(h)


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
        self._layout_device: torch.device | None = None

    def attach_experts(self, provider: ExpertStore) -> None:
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

    def prepare_decode_layout(self, device: torch.device) -> None:
        """On CPU, hold every dense nn.Linear weight [out, in] as a view of an [in, out] buffer.

        MKL's GEMV (one decode token) reads a weight stored [in, out] 1.3-3x faster on these
        AVX2 CPUs (lm_head 32000 x 1024 fp32: 19 vs 25 ms, 1 thread; bench/decode.py) and GEMMs
        (prefill) run as fast either way. Values and the state dict are unchanged (a transposed
        view has the same [out, in] shape); each weight is copied once, then the old buffer is
        dropped. MLA's kv_b_proj keeps its layout (its weight is reshaped per head). Runs at the
        first forward; on other devices it changes nothing.
        """
        self._layout_device = device
        if device.type != "cpu":
            return
        with torch.inference_mode(False), torch.no_grad():
            for name, module in self.named_modules():
                if type(module) is not nn.Linear or name.endswith("kv_b_proj"):
                    continue
                w = module.weight
                if w.device.type == "cpu" and w.is_contiguous() and w.dim() == 2 and w.shape[0] > 1:
                    module.weight = nn.Parameter(w.t().contiguous().t(), requires_grad=False)

    def forward(self, tokens: torch.Tensor, ctx: StepContext, *, last_only: bool = False) -> torch.Tensor:
        """tokens [T] -> logits [T, V] (or [1, V] with last_only), eagerly; the decode layout is
        prepared on the first pass on a device. Sessions run it through the engine's
        `decode_runner.DecodeRunner`, which replays a CUDA graph instead when it can."""
        if self._layout_device != tokens.device:
            self.prepare_decode_layout(tokens.device)
        return self.forward_layers(tokens, ctx, last_only=last_only)

    def forward_layers(
        self, tokens: torch.Tensor, ctx: StepContext, *, last_only: bool = False
    ) -> torch.Tensor:
        """The eager forward: tokens [T] -> logits [T, V] (or [1, V] with last_only)."""
        x = self.embed_tokens(tokens)  # [T, H]
        for layer in self.layers:
            x = layer(x, ctx)
        if last_only:
            x = x[-1:]
        h = self.norm.forward(x)
        # `lm_head` is an nn.Linear (untied), an int8.Int8Linear (`quantize_dense`, tied or not), or
        # absent (tied float head); nn.Linear and F.linear with the same weight are the same op.
        head = getattr(self, "lm_head", None)
        return linear(head, h) if head is not None else F.linear(h, self.embed_tokens.weight)
