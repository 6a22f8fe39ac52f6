"""Model shapes for the simulator: what a MoE model weighs and moves per token, from its config.json.

A `ModelShape` is built from a Hugging Face config.json through the engine's own adapters
(`adapter_for(model_type).build_spec(config_from_dict(raw))`), so the simulator models exactly the
layers, experts and attention the engine would run. Built-in names (`BUILTIN_CONFIGS`) hold the
public config.json values of real checkpoints and go through the same path.

Byte counts are exact for the FTW codecs (`engine/ftw/codecs.py`): each weight's parts as the codec's
`part_specs` lays them out (payload plus scales), e.g. ``"mxfp4"`` stores 16 bytes of E2M1 codes and
one E8M0 byte per 32 weights (0.53125 bytes per weight), ``"fp8_e4m3"`` one fp32 ``scale_inv`` per
128x128 block, ``"int8"`` one fp32 scale per output row. As `freetoken convert` does, a weight the
codec cannot represent (MXFP4 with an input dim not a multiple of 32) counts in ``"bf16"``, and expert
biases (gpt-oss) count in ``"fp32"`` when the codec is ``"fp32"``, else in ``"bf16"``. Routed experts
count as the canonical fused ``gate_up [2I, H]`` and ``down [H, I]``; DeepSeek-V3 fp8 experts carried
over from the checkpoint keep ``gate``/``up`` apart, which is the same number of bytes whenever I is
a multiple of 128 (it is). `expert_bytes` is the payload a transfer moves; `expert_block_bytes` is
the expert's span in an FTW file (64-byte block header and part alignment, 4 KiB block alignment).

What `dense_bytes_per_token` counts (every weight a decode token reads besides its routed experts):
attention projections (GQA q/k/v/o, or MLA's q_a/q_b/kv_a/kv_b/o), their biases and q/k norms,
attention sinks, the two RMSNorms per layer and the final norm, each MoE layer's router (and
DeepSeek-V3's score correction bias, both kept in fp32 by the engine), shared experts (and Qwen2-MoE's
shared-expert gate), the dense MLPs of non-MoE layers, ONE embedding row (a lookup reads one row,
not the table), and the WHOLE lm_head (the logits GEMV reads all of it every token: for
Qwen3-30B-A3B that is 622 MB of the ~1.07 GB a token reads, see FACTS.md). `lm_head_bytes` gives
that part alone. DeepSeek-V3's multi-token-prediction layer (``num_nextn_predict_layers``) is not
part of the model the engine runs and is not counted.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EngineError
from ..ftw.codecs import CODECS, get_codec
from ..ftw.layout import ALIGNMENT, BLOCK_HEADER_SIZE, PART_ALIGN
from ..loading.convert import QUANT_CODECS
from ..spec import AttentionSpec, ModelSpec, MoESpec
from .builtin_models import BUILTIN_CONFIGS

__all__ = [
    "BUILTIN_CONFIGS",
    "CODEC_ALIASES",
    "GGUF_BITS",
    "ModelShape",
    "codec_name",
    "shape_for",
    "shape_from_config",
    "shape_from_spec",
]

CODEC_ALIASES: dict[str, str] = QUANT_CODECS
"""``freetoken convert --quant`` names -> FTW codec names (`loading.convert.QUANT_CODECS`; codec
names themselves are accepted too)."""
FALLBACK_CODEC = "bf16"
"""Codec a weight is counted in when the requested one cannot represent it (as convert does)."""
GGUF_BITS: dict[str, float] = {
    "q8_0": 8.5,  # llama.cpp ggml-common.h: 32 int8 + one fp16 scale per block (34 bytes)
    "q6_k": 6.5625,  # 210 bytes per 256-weight super-block
    "q5_k": 5.5,  # 176 bytes per 256
    "q4_k": 4.5,  # 144 bytes per 256
    # A Q4_K_M file mixes Q4_K with Q6_K (some down projections, the output) and keeps small
    # tensors wider; estimate from published file sizes: Qwen3-30B-A3B-Q4_K_M ~18.6 GB for 30.5 B
    # parameters (4.88 bits), DeepSeek-V3-Q4_K_M ~404 GB for 671 B (4.82 bits).
    "q4_k_m": 4.85,
}
"""llama.cpp's GGUF types priced at their own bits per weight (what llama.cpp holds in memory and
computes from): a simulator-only codec name, for the peers' setups; not an FTW codec."""


def codec_name(codec: str) -> str:
    """The FTW codec name for a quant name (``"fp8"`` -> ``"fp8_e4m3"``) or a codec name; ValueError
    listing the accepted names otherwise."""
    if codec in CODEC_ALIASES:
        return CODEC_ALIASES[codec]
    if codec in CODECS or codec in GGUF_BITS:
        return codec
    known = sorted(set(CODEC_ALIASES) | set(CODECS) | set(GGUF_BITS))
    raise ValueError(f"unknown codec {codec!r}; known: {', '.join(known)}")


def _part_bytes(shape: tuple[int, ...], codec: str) -> list[int]:
    """Bytes of each stored part of one tensor of `shape` in `codec` (falling back as convert does)."""
    if codec in GGUF_BITS:
        return [math.ceil(math.prod(shape) * GGUF_BITS[codec] / 8)]
    try:
        specs = get_codec(codec).part_specs(shape)
    except ValueError:
        specs = get_codec(FALLBACK_CODEC).part_specs(shape)
    return [math.prod(shp) * dtype.itemsize for dtype, shp in specs.values()]


def _matrix_bytes(out: int, inp: int, codec: str) -> int:
    return sum(_part_bytes((out, inp), codec))


def _vector_codec(codec: str) -> str:
    return "fp32" if codec == "fp32" else "bf16"


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a MoE model the simulator needs (see the module docstring for what is counted).

    Attributes:
        name: display name (a built-in name, or the config's model_type).
        model_type: the Hugging Face model_type.
        num_layers: all transformer layers (dense and MoE).
        moe_layers: indices of the MoE layers (the ``layer`` of routing-trace records).
        num_experts / top_k: routed experts per MoE layer and how many each token uses.
        hidden: hidden size H.
        intermediate: routed expert intermediate size I.
        gated: True when an expert has 3 matrices (gate, up, down): all supported architectures.
        expert_bias: experts carry biases (gpt-oss): ``gate_up_bias [2I]``, ``down_bias [H]``.
        vocab_size: rows of the embedding and lm_head.
        tie_word_embeddings: lm_head is the embedding matrix (counted once in parameters).
        dense_matrices: ``(count, out, in)`` of every 2-D weight besides routed experts, embedding
            and lm_head (attention, shared experts, dense MLPs, bf16 routers), summed over layers.
        dense_vector_elems: elements of 1-D weights (norms, biases, sinks) over all layers.
        fp32_elems: elements the engine keeps in fp32 whatever the codec (DeepSeek-V3 router weight
            and score correction bias).
    """

    name: str
    model_type: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    gated: bool
    expert_bias: bool
    vocab_size: int
    tie_word_embeddings: bool
    dense_matrices: tuple[tuple[int, int, int], ...]
    dense_vector_elems: int
    fp32_elems: int
    kv_elems_per_token: int = 0  # K and V elements one token adds to the cache, all layers

    # ---- routed experts ---------------------------------------------------------------------
    def _expert_tensors(self) -> tuple[list[tuple[int, int]], list[int]]:
        h, i = self.hidden, self.intermediate
        mats = [((2 if self.gated else 1) * i, h), (h, i)]
        biases = [(2 if self.gated else 1) * i, h] if self.expert_bias else []
        return mats, biases

    def expert_params(self) -> int:
        """Parameters of one routed expert (weights and biases)."""
        mats, biases = self._expert_tensors()
        return sum(o * n for o, n in mats) + sum(biases)

    def expert_bytes(self, codec: str = "bf16") -> int:
        """Exact stored bytes of one routed expert in `codec` (payload and scales, no padding)."""
        c = codec_name(codec)
        mats, biases = self._expert_tensors()
        vc = _vector_codec(c)
        return sum(_matrix_bytes(o, n, c) for o, n in mats) + sum(sum(_part_bytes((b,), vc)) for b in biases)

    def expert_block_bytes(self, codec: str = "bf16") -> int:
        """Bytes one routed expert spans in an FTW file: its block header, each part aligned to 64
        bytes, the block rounded up to 4 KiB (uncompressed)."""
        c = codec_name(codec)
        mats, biases = self._expert_tensors()
        vc = _vector_codec(c)
        parts = [p for o, n in mats for p in _part_bytes((o, n), c)]
        parts += [p for b in biases for p in _part_bytes((b,), vc)]
        raw = sum(_round_up(p, PART_ALIGN) for p in parts)
        return _round_up(BLOCK_HEADER_SIZE + raw, ALIGNMENT)

    def total_expert_bytes(self, codec: str = "bf16") -> int:
        """Bytes of every routed expert of every MoE layer in `codec`."""
        return len(self.moe_layers) * self.num_experts * self.expert_bytes(codec)

    def routed_bytes_per_token(self, codec: str = "bf16") -> int:
        """Routed-expert bytes one decode token reads: top_k experts in every MoE layer."""
        return len(self.moe_layers) * self.top_k * self.expert_bytes(codec)

    def expert_flops_per_token(self) -> int:
        """FLOPs (2 per multiply-add) of one routed expert on one token (biases and activation not
        counted)."""
        mats, _ = self._expert_tensors()
        return 2 * sum(o * n for o, n in mats)

    def routed_flops_per_token(self) -> int:
        """FLOPs of all routed experts one token runs (top_k per MoE layer)."""
        return len(self.moe_layers) * self.top_k * self.expert_flops_per_token()

    # ---- everything else ----------------------------------------------------------------------
    def lm_head_bytes(self, codec: str = "bf16") -> int:
        """Bytes of the lm_head [vocab, H] in `codec` (read whole by every decode token)."""
        return _matrix_bytes(self.vocab_size, self.hidden, codec_name(codec))

    def dense_bytes_per_token(self, codec: str = "bf16") -> int:
        """Bytes of the non-routed weights one decode token reads, 2-D weights in `codec` (1-D ones
        in bf16, or fp32 for ``"fp32"``; DeepSeek's router in fp32): see the module docstring."""
        c = codec_name(codec)
        vc = _vector_codec(c)
        mats = sum(count * _matrix_bytes(o, n, c) for count, o, n in self.dense_matrices)
        # + the final norm and one embedding row
        vectors = sum(_part_bytes((self.dense_vector_elems + 2 * self.hidden,), vc))
        return mats + vectors + 4 * self.fp32_elems + self.lm_head_bytes(c)

    def dense_resident_bytes(self, codec: str = "bf16") -> int:
        """Bytes of every non-routed weight held where the dense part runs: 2-D weights in `codec`
        (the embedding table too, once if tied), 1-D ones as `dense_bytes_per_token` counts them."""
        c = codec_name(codec)
        embed = 0 if self.tie_word_embeddings else _matrix_bytes(self.vocab_size, self.hidden, c)
        return self.dense_bytes_per_token(c) + embed

    def kv_bytes(self, tokens: int, dtype_bytes: int = 2) -> int:
        """Bytes of the KV cache of `tokens` tokens (bf16 unless `dtype_bytes` says otherwise)."""
        return tokens * self.kv_elems_per_token * dtype_bytes

    def dense_flops_per_token(self) -> int:
        """FLOPs of the non-routed matrices one token runs, lm_head included (attention scores over
        the context not counted: they grow with its length)."""
        mats = sum(count * o * n for count, o, n in self.dense_matrices)
        return 2 * (mats + self.vocab_size * self.hidden)

    def dense_params(self) -> int:
        """Parameters besides routed experts: embedding, lm_head (once if tied), everything else."""
        mats = sum(count * o * n for count, o, n in self.dense_matrices)
        embed = self.vocab_size * self.hidden * (1 if self.tie_word_embeddings else 2)
        return mats + self.dense_vector_elems + self.hidden + self.fp32_elems + embed

    def total_params(self) -> int:
        """All parameters of the model (routed experts included)."""
        return self.dense_params() + len(self.moe_layers) * self.num_experts * self.expert_params()

    def active_params_per_token(self) -> int:
        """Parameters one token uses: all dense ones (the whole embedding table included, as model
        cards count it) and top_k experts per MoE layer."""
        return self.dense_params() + len(self.moe_layers) * self.top_k * self.expert_params()


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


# ---- building shapes --------------------------------------------------------------------------


def _attention_weights(a: AttentionSpec, h: int, mats: Counter, vectors: list[int]) -> None:
    if a.kind == "mla":
        q_dim = a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
        if a.q_lora_rank:
            mats[(a.q_lora_rank, h)] += 1
            mats[(q_dim, a.q_lora_rank)] += 1
            vectors.append(a.q_lora_rank)  # q_a_layernorm
            if a.qkv_bias:
                vectors.append(a.q_lora_rank)
        else:
            mats[(q_dim, h)] += 1
            if a.qkv_bias:
                vectors.append(q_dim)
        kv_a = a.kv_lora_rank + a.qk_rope_head_dim
        mats[(kv_a, h)] += 1
        mats[(a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)] += 1
        vectors.append(a.kv_lora_rank)  # kv_a_layernorm
        if a.qkv_bias:
            vectors.append(kv_a)
        mats[(h, a.num_heads * a.v_head_dim)] += 1
        if a.o_bias:
            vectors.append(h)
        return
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    mats[(q, h)] += 1
    mats[(kv, h)] += 2
    mats[(h, q)] += 1
    if a.qkv_bias:
        vectors += [q, kv, kv]
    if a.o_bias:
        vectors.append(h)
    if a.qk_norm == "per_head":
        vectors += [a.head_dim, a.head_dim]
    elif a.qk_norm == "full":
        vectors += [q, kv]
    if a.sinks:
        vectors.append(a.num_heads)


def shape_from_spec(spec: ModelSpec, name: str | None = None) -> ModelShape:
    """The shape of an engine `ModelSpec`. ValueError when its MoE layers differ in experts, top-k
    or sizes (no supported architecture does that)."""
    h = spec.hidden_size
    moe_layers = tuple(spec.moe_layers())
    if not moe_layers:
        raise ValueError(f"{name or spec.model_type}: the model has no MoE layer")
    moes: set[MoESpec] = {spec.layers[i].moe for i in moe_layers}  # type: ignore[misc]
    sizes = {(m.num_experts, m.top_k, m.intermediate_size, m.expert_bias) for m in moes}
    if len(sizes) != 1:
        raise ValueError(
            f"{name or spec.model_type}: MoE layers differ in experts/top-k/sizes: {sorted(sizes)}"
        )
    num_experts, top_k, intermediate, expert_bias = sizes.pop()
    mats: Counter[tuple[int, int]] = Counter()
    vectors: list[int] = [h]  # final norm
    fp32 = kv = 0
    for layer in spec.layers:
        _attention_weights(layer.attention, h, mats, vectors)
        a = layer.attention  # MLA caches its compressed latent and the rope key, as llama.cpp does
        kv += a.kv_lora_rank + a.qk_rope_head_dim if a.kind == "mla" else 2 * a.num_kv_heads * a.head_dim
        vectors += [h, h]  # input and post-attention norms
        moe = layer.moe
        if moe is None:
            d = layer.dense_intermediate_size
            mats[(2 * d, h)] += 1
            mats[(h, d)] += 1
            continue
        if moe.routing == "sigmoid_group_topk":
            fp32 += moe.num_experts * h + moe.num_experts  # router weight + e_score_correction_bias
        else:
            mats[(moe.num_experts, h)] += 1
            if moe.router_bias:
                vectors.append(moe.num_experts)
        if moe.shared != "none" and moe.shared_intermediate_size:
            s = moe.shared_intermediate_size
            mats[(2 * s, h)] += 1
            mats[(h, s)] += 1
            if moe.shared == "gated":
                mats[(1, h)] += 1
    # The tuple excludes the final norm, which `dense_params` and `dense_bytes_per_token` add as `hidden`.
    return ModelShape(
        name=name or spec.model_type,
        model_type=spec.model_type,
        num_layers=spec.num_layers,
        moe_layers=moe_layers,
        num_experts=num_experts,
        top_k=top_k,
        hidden=h,
        intermediate=intermediate,
        gated=True,  # every adapter's experts are gate/up/down (SwiGLU or gpt-oss's clamped SwiGLU)
        expert_bias=expert_bias,
        vocab_size=spec.vocab_size,
        tie_word_embeddings=spec.tie_word_embeddings,
        dense_matrices=tuple(sorted((count, o, n) for (o, n), count in mats.items())),
        dense_vector_elems=sum(vectors) - h,
        fp32_elems=fp32,
        kv_elems_per_token=kv,
    )


def shape_from_config(config: str | Path | Mapping[str, Any], name: str | None = None) -> ModelShape:
    """The shape of a model from its config.json: a dict, a config.json path or a checkpoint folder.

    Goes through the engine's adapter for the config's model_type. EngineError (one line, naming
    the source) for an unreadable file, a config without model_type, or one transformers refuses;
    UnsupportedModelError for a model_type no adapter handles.
    """
    from ..adapters import adapter_for
    from ..checkpoint import config_from_dict

    if isinstance(config, Mapping):
        raw, where = dict(config), name or "config"
    else:
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        where = str(path)
        if _is_ftw(path):  # a converted checkpoint: its manifest holds the config.json it came from
            raw = _ftw_config(path)
        else:
            raw = _read_config(path, where)
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise EngineError(f"{where}: not a Hugging Face config (no 'model_type')")
    adapter = adapter_for(raw["model_type"])
    try:
        hf_config = config_from_dict(raw)
    except (KeyError, ValueError, TypeError) as e:
        raise EngineError(f"{where}: transformers refuses this config: {e}") from None
    spec = adapter.build_spec(hf_config)
    try:
        return shape_from_spec(spec, name=name or raw["model_type"])
    except ValueError as e:
        raise EngineError(f"{where}: {e}") from None


def _read_config(path: Path, where: str) -> Any:
    """A config.json file's JSON; EngineError in one line when it cannot be read as one."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise EngineError(f"cannot read model config {where}: {e}") from None
    except RecursionError:  # json's scanner recurses once per nesting level
        raise EngineError(f"cannot read model config {where}: JSON nested too deeply") from None
    except ValueError as e:  # not UTF-8, or an int past Python's 4300-digit limit
        if isinstance(e, UnicodeDecodeError) and path.suffix.lower() != ".json":  # another kind of file
            raise EngineError(
                f"cannot read model config {where}: not UTF-8 text (a model is a built-in name "
                f"({', '.join(BUILTIN_CONFIGS)}), a config.json, a checkpoint folder or an FTW file)"
            ) from None
        why = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else "a number too long to read"
        raise EngineError(f"cannot read model config {where}: {why}") from None


def _is_ftw(path: Path) -> bool:
    """Whether `path` is a file that starts with the FTW magic."""
    from ..ftw.layout import MAGIC

    try:
        with path.open("rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False  # `_read_config` names the file and why


def _ftw_config(path: Path) -> Any:
    """The model config an FTW file's manifest holds (its checksums checked, no tensor read)."""
    from ..ftw.reader import FTWFile

    with FTWFile(path) as ftw:
        return ftw.model_config


def shape_for(name_or_path: str | Path) -> ModelShape:
    """A built-in model's shape by name (`BUILTIN_CONFIGS`), or the shape of a config.json file or
    checkpoint folder. EngineError in one line listing the built-in names when it is neither."""
    key = str(name_or_path)
    if key.lower() in BUILTIN_CONFIGS:
        return shape_from_config(BUILTIN_CONFIGS[key.lower()], name=key.lower())
    path = Path(name_or_path)
    if path.exists():
        return shape_from_config(path)
    raise EngineError(
        f"unknown model {key!r}: not a built-in ({', '.join(BUILTIN_CONFIGS)}) nor a config.json path"
    )
