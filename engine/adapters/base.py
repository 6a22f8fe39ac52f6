"""What an architecture adapter is, and the pieces most adapters share.

An adapter turns a Hugging Face config into a `ModelSpec`, names the checkpoint tensor behind
each dense engine parameter, and yields each routed expert's tensors in the canonical layout
(`gate_up [2I, H]` gate rows first, `down [H, I]`, optional biases).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..checkpoint import SafetensorsCheckpoint
from ..errors import CheckpointError, UnsupportedModelError
from ..spec import AttentionSpec, ModelSpec, RopeSpec

# RoPE variants whose frequencies change with the sequence length are not implemented.
_SUPPORTED_ROPE = {"default", "linear", "yarn", "llama3"}


class Adapter:
    """Base adapter; subclasses set `model_types` and implement `build_spec` (and quirks)."""

    model_types: tuple[str, ...] = ()
    #: checkpoint prefix of the MoE sub-module of a layer ("mlp" or "block_sparse_moe")
    moe_prefix = "mlp"
    #: checkpoint names of an expert's gate, up and down projections (per-expert layout)
    expert_names = ("gate_proj", "up_proj", "down_proj")
    #: checkpoint name of the router module inside the MoE sub-module
    router_name = "gate"
    #: checkpoint name of the shared expert module inside the MoE sub-module
    shared_name = "shared_expert"

    def build_spec(self, config: PretrainedConfig) -> ModelSpec:
        raise NotImplementedError

    # ---- dense weights -------------------------------------------------------------------
    def hf_name(self, name: str) -> str:
        """Checkpoint tensor name behind the engine parameter `name`."""
        if name.startswith("lm_head."):
            return name
        parts = name.split(".")
        if parts[0] == "layers" and parts[2] == "mlp" and parts[3] in ("router", "shared_expert"):
            sub = self.router_name if parts[3] == "router" else self.shared_name
            name = ".".join([*parts[:2], self.moe_prefix, sub, *parts[4:]])
        elif parts[0] == "layers" and parts[2] == "mlp" and parts[3] == "shared_expert_gate":
            name = ".".join([*parts[:2], self.moe_prefix, *parts[3:]])
        return "model." + name

    # ---- routed experts ------------------------------------------------------------------
    def layer_experts(
        self, ckpt: SafetensorsCheckpoint, layer: int, num_experts: int
    ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """(expert id, canonical tensors) for every routed expert of `layer`.

        Reads the per-expert layout real checkpoints use, or the fused 3-D layout
        (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`).
        """
        base = f"model.layers.{layer}.{self.moe_prefix}.experts"
        if ckpt.has(f"{base}.gate_up_proj"):
            gate_up, down = ckpt.get(f"{base}.gate_up_proj"), ckpt.get(f"{base}.down_proj")
            _check_experts(gate_up, num_experts, base)
            for e in range(num_experts):
                yield e, {"gate_up": gate_up[e], "down": down[e]}
            return
        g, u, d = self.expert_names
        for e in range(num_experts):
            prefix = f"{base}.{e}"
            gate, up = ckpt.get(f"{prefix}.{g}.weight"), ckpt.get(f"{prefix}.{u}.weight")
            yield e, {"gate_up": torch.cat([gate, up], dim=0), "down": ckpt.get(f"{prefix}.{d}.weight")}


def _check_experts(fused: torch.Tensor, num_experts: int, name: str) -> None:
    if fused.shape[0] != num_experts:
        raise CheckpointError(f"{name} holds {fused.shape[0]} experts but the config says {num_experts}")


def rope_spec(config: PretrainedConfig, head_dim: int, *, interleaved: bool = False) -> RopeSpec:
    """Inverse frequencies exactly as transformers computes them for this config."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in _SUPPORTED_ROPE:
        raise UnsupportedModelError(
            f"RoPE type '{rope_type}' is not supported (supported: {sorted(_SUPPORTED_ROPE)})"
        )
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return RopeSpec(inv_freq=inv_freq, attention_scaling=1.0, interleaved=interleaved)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return RopeSpec(inv_freq=inv_freq.float(), attention_scaling=float(scaling), interleaved=interleaved)


def sliding_window(config: PretrainedConfig, layer: int) -> int | None:
    """The layer's attention window, following the reference masks."""
    window = getattr(config, "sliding_window", None) or None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer] == "sliding_attention" else None
    return window


def gqa(config: PretrainedConfig, layer: int, **overrides: object) -> AttentionSpec:
    """Grouped-query attention spec from the usual config fields."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    fields: dict = dict(
        kind="gqa",
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        scaling=head_dim**-0.5,
        sliding_window=sliding_window(config, layer),
    )
    fields.update(overrides)
    return AttentionSpec(**fields)


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def common_spec_fields(config: PretrainedConfig) -> dict:
    return dict(
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )
