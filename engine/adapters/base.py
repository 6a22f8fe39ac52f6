"""What an architecture adapter is, and the pieces most adapters share.

An adapter turns a Hugging Face config into a `ModelSpec`, names the checkpoint tensor behind
each dense engine parameter, and yields each routed expert's tensors in the canonical layout
(`gate_up [2I, H]` gate rows first, `down [H, I]`, optional biases).

Pre-quantized checkpoints: DeepSeek-V3 style fp8 weights (`*.weight` float8_e4m3fn with a
`*.weight_scale_inv` fp32 grid of 128x128 blocks) are dequantized exactly to fp32 wherever a float
tensor is asked for (`dense_tensor`, `layer_experts`), never reinterpreted as floats; and
`layer_experts_encoded` hands the stored bytes over untouched (as FTW `EncodedTensor`s) so that a
conversion to FTW needs no lossy round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ..checkpoint import SafetensorsCheckpoint
from ..errors import CheckpointError, UnsupportedModelError
from ..ftw.codecs import EncodedTensor, decode, encode, wrap_fp8_block
from ..spec import AttentionSpec, ModelSpec, RopeSpec
from ..spec_checks import check_config, check_spec

#: suffix of the inverse-scale grid stored next to an fp8 weight (DeepSeek-V3 convention)
FP8_SCALE_SUFFIX = "_scale_inv"
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# RoPE variants whose frequencies change with the sequence length are not implemented.
_SUPPORTED_ROPE = {"default", "linear", "yarn", "llama3"}


class Adapter:
    """Base adapter; subclasses set `model_types` and implement `make_spec` (and quirks)."""

    model_types: tuple[str, ...] = ()
    #: checkpoint prefix of the MoE sub-module of a layer ("mlp" or "block_sparse_moe")
    moe_prefix = "mlp"
    #: checkpoint names of an expert's gate, up and down projections (per-expert layout)
    expert_names = ("gate_proj", "up_proj", "down_proj")
    #: checkpoint name of the router module inside the MoE sub-module
    router_name = "gate"
    #: checkpoint name of the shared expert module inside the MoE sub-module
    shared_name = "shared_expert"

    def build_spec(self, config: PretrainedConfig, where: str | None = None) -> ModelSpec:
        """The spec of `config`, its hyper-parameters checked first (`spec_checks.check_config`:
        CheckpointError naming `where`, the key and the value) and its rotary frequencies after."""
        where = where or getattr(config, "_name_or_path", "") or f"{config.model_type} config"
        check_config(config, where)
        spec = self.make_spec(config)
        check_spec(spec, where)
        return spec

    def make_spec(self, config: PretrainedConfig) -> ModelSpec:
        """The spec of a checked config (each architecture's own mapping)."""
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

    def dense_tensor(self, ckpt: SafetensorsCheckpoint, name: str) -> torch.Tensor:
        """The float tensor behind engine parameter `name`, fp8 block weights dequantized to fp32."""
        return dequantized(self.hf_name(name), ckpt.get, ckpt.has, str(ckpt.folder))

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
            if gate_up.dtype in _FP8_DTYPES or down.dtype in _FP8_DTYPES:
                raise CheckpointError(f"{base}: fused fp8 expert tensors are not supported")
            for e in range(num_experts):
                yield e, {"gate_up": gate_up[e], "down": down[e]}
            return
        g, u, d = self.expert_names
        where = str(ckpt.folder)
        for e in range(num_experts):
            prefix = f"{base}.{e}"
            gate, up, down = (
                dequantized(f"{prefix}.{n}.weight", ckpt.get, ckpt.has, where) for n in (g, u, d)
            )
            yield e, {"gate_up": torch.cat([gate, up], dim=0), "down": down}

    def layer_experts_encoded(
        self, ckpt: SafetensorsCheckpoint, layer: int, num_experts: int
    ) -> Iterator[tuple[int, dict[str, EncodedTensor] | None]]:
        """(expert id, stored projections) for every routed expert of `layer`, without decoding.

        For checkpoints whose experts are already quantized, the dict holds the weights exactly as
        stored, as FTW `EncodedTensor`s (here: DeepSeek-V3 fp8 per-expert weights as ``"gate"``,
        ``"up"`` ``[I, H]`` and ``"down"`` ``[H, I]`` in codec ``"fp8_e4m3"``; gate and up stay separate
        because their 128x128 scale grids only concatenate when I is a multiple of 128), plus any
        biases in a plain codec (``"fp32"``/``"bf16"``). For float checkpoints it yields None per
        expert: use `layer_experts` then.
        """
        base = f"model.layers.{layer}.{self.moe_prefix}.experts"
        g, u, d = self.expert_names
        first = f"{base}.0.{g}.weight"
        if (
            ckpt.has(f"{base}.gate_up_proj")
            or not ckpt.has(first)
            or ckpt.get(first).dtype not in _FP8_DTYPES
        ):
            for e in range(num_experts):
                yield e, None
            return
        for e in range(num_experts):
            prefix = f"{base}.{e}"
            yield (
                e,
                {
                    key: fp8_encoded(f"{prefix}.{n}.weight", ckpt.get, ckpt.has, str(ckpt.folder))
                    for key, n in (("gate", g), ("up", u), ("down", d))
                },
            )


def fp8_encoded(
    name: str, get: Callable[[str], torch.Tensor], has: Callable[[str], bool], where: str
) -> EncodedTensor:
    """The fp8 weight `name` and its `name + "_scale_inv"` grid as an ``"fp8_e4m3"`` EncodedTensor.

    The bytes are not touched. CheckpointError if the weight is not float8_e4m3fn, has no scale grid,
    or the grid's shape is not ``[ceil(out/128), ceil(in/128)]``.
    """
    weight = get(name)
    scale_name = name + FP8_SCALE_SUFFIX
    if weight.dtype != torch.float8_e4m3fn:
        raise CheckpointError(
            f"tensor '{name}' in {where} is {weight.dtype}; only float8_e4m3fn is supported"
        )
    if not has(scale_name):
        raise CheckpointError(
            f"fp8 tensor '{name}' in {where} has no '{scale_name}': cannot dequantize it without its scales"
        )
    try:
        return wrap_fp8_block(weight, get(scale_name))
    except ValueError as e:
        raise CheckpointError(f"fp8 tensor '{name}' in {where}: {e}") from e


def dequantized(
    name: str, get: Callable[[str], torch.Tensor], has: Callable[[str], bool], where: str
) -> torch.Tensor:
    """Tensor `name` from `get`; an fp8 block-quantized weight comes back dequantized in fp32.

    `get`/`has` look tensors up by name (a safetensors checkpoint, an FTW file's dense tensors);
    `where` names the source in errors. Dequantization (``weight.float() * scale_inv`` per 128x128
    block) is exact in fp32. CheckpointError for fp8 tensors without a usable scale grid.
    """
    t = get(name)
    if t.dtype in _FP8_DTYPES:
        return decode(fp8_encoded(name, get, has, where), torch.float32)
    return t


def plain_encoded(t: torch.Tensor) -> EncodedTensor:
    """`t` (e.g. a bias) in the plain codec of its own dtype: ``"bf16"`` for bf16, else ``"fp32"``."""
    return encode(t, "bf16" if t.dtype == torch.bfloat16 else "fp32")


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
