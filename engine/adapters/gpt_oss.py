"""gpt-oss: attention sinks, alternating sliding/full attention, biased router with softmax over
the top-k logits, clamped SwiGLU experts with biases, fused (optionally MXFP4) expert tensors.

The checkpoint interleaves gate and up columns (`gate = gu[..., ::2]`, `up = gu[..., 1::2]`);
the canonical expert layout puts the gate rows first, so rows are de-interleaved at load. For
MXFP4 that is a permutation of whole quantization blocks, so it is lossless.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PretrainedConfig

from ..checkpoint import SafetensorsCheckpoint
from ..errors import CheckpointError
from ..ftw.codecs import EncodedTensor, decode, wrap_mxfp4
from ..spec import LayerSpec, ModelSpec, MoESpec
from .base import Adapter, _check_experts, common_spec_fields, gqa, head_dim_of, plain_encoded, rope_spec

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0
"""gpt-oss's clamped SwiGLU constants (used when the config does not carry them)."""


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """Rows (g0, u0, g1, u1, ...) -> (g0, g1, ..., u0, u1, ...) along dim 0."""
    return torch.cat([t[0::2], t[1::2]], dim=0)


class GptOssAdapter(Adapter):
    model_types = ("gpt_oss",)
    router_name = "router"

    def make_spec(self, config: PretrainedConfig) -> ModelSpec:
        moe = MoESpec(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            routing="topk_softmax",
            router_bias=True,
            activation="gpt_oss_swiglu",
            expert_bias=True,
            # transformers < 5.24 does not set these on GptOssConfig: the architecture's values.
            swiglu_alpha=float(getattr(config, "swiglu_alpha", None) or SWIGLU_ALPHA),
            swiglu_limit=float(getattr(config, "swiglu_limit", None) or SWIGLU_LIMIT),
        )
        bias = bool(config.attention_bias)
        layers = tuple(
            LayerSpec(gqa(config, i, qkv_bias=bias, o_bias=bias, sinks=True), moe)
            for i in range(config.num_hidden_layers)
        )
        return ModelSpec(
            **common_spec_fields(config),
            layers=layers,
            rope=rope_spec(config, head_dim_of(config)),
            norm_weight_in_fp32=True,
        )

    def layer_experts(
        self, ckpt: SafetensorsCheckpoint, layer: int, num_experts: int
    ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        encoded = self.layer_experts_encoded(ckpt, layer, num_experts)
        base = f"model.layers.{layer}.mlp.experts"
        if ckpt.has(f"{base}.gate_up_proj_blocks"):
            # MXFP4 decodes exactly to fp32 (E2M1 values times powers of two).
            for e, enc in encoded:
                assert enc is not None
                yield e, {name: decode(t) for name, t in enc.items()}
            return
        gate_up_bias = ckpt.get(f"{base}.gate_up_proj_bias")  # [E, 2I]
        down_bias = ckpt.get(f"{base}.down_proj_bias")  # [E, H]
        gate_up, down = ckpt.get(f"{base}.gate_up_proj"), ckpt.get(f"{base}.down_proj")  # [E,H,2I], [E,I,H]
        _check_experts(gate_up, num_experts, f"{base}.gate_up_proj")
        for e in range(num_experts):
            yield (
                e,
                {
                    "gate_up": deinterleave_rows(gate_up[e].T),
                    "down": down[e].T,
                    "gate_up_bias": deinterleave_rows(gate_up_bias[e]),
                    "down_bias": down_bias[e],
                },
            )

    def layer_experts_encoded(
        self, ckpt: SafetensorsCheckpoint, layer: int, num_experts: int
    ) -> Iterator[tuple[int, dict[str, EncodedTensor] | None]]:
        """MXFP4 experts as stored: ``"gate_up"`` ``[2I, H]`` and ``"down"`` ``[H, I]`` in codec
        ``"mxfp4"`` (blocks/scales rows de-interleaved to gate-first, a lossless permutation of whole
        rows), biases in their own plain codec; None per expert for float checkpoints."""
        base = f"model.layers.{layer}.mlp.experts"
        if not ckpt.has(f"{base}.gate_up_proj_blocks"):
            for e in range(num_experts):
                yield e, None
            return
        gate_up_bias = ckpt.get(f"{base}.gate_up_proj_bias")  # [E, 2I]
        down_bias = ckpt.get(f"{base}.down_proj_bias")  # [E, H]
        gu_blocks, gu_scales = (
            ckpt.get(f"{base}.gate_up_proj_blocks"),
            ckpt.get(f"{base}.gate_up_proj_scales"),
        )
        d_blocks, d_scales = ckpt.get(f"{base}.down_proj_blocks"), ckpt.get(f"{base}.down_proj_scales")
        _check_experts(gu_blocks, num_experts, f"{base}.gate_up_proj_blocks")
        _check_experts(d_blocks, num_experts, f"{base}.down_proj_blocks")
        for e in range(num_experts):
            try:
                # blocks [out, in/32, 16] are already [out, in]-major: no transpose needed.
                gu = wrap_mxfp4(deinterleave_rows(gu_blocks[e]), deinterleave_rows(gu_scales[e]))
                dn = wrap_mxfp4(d_blocks[e], d_scales[e])
            except ValueError as err:
                raise CheckpointError(f"{base}, expert {e}: bad MXFP4 tensors: {err}") from err
            yield (
                e,
                {
                    "gate_up": gu,
                    "down": dn,
                    "gate_up_bias": plain_encoded(deinterleave_rows(gate_up_bias[e])),
                    "down_bias": plain_encoded(down_bias[e]),
                },
            )
