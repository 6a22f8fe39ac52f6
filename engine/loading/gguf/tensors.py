"""Where each engine weight lives in a GGUF file, and how it was transformed there.

Dense weights: engine parameter -> Hugging Face name (the architecture's `Adapter.hf_name`) ->
GGUF name through gguf-py's own tensor-name map (`gguf.get_tensor_name_map`, the table llama.cpp's
converter writes with), plus the few names it lacks (gpt-oss ``attn_sinks``). Values are
dequantized to float by `gguf.quants.dequantize`; a 1-D GGUF tensor that is ``[1, H]`` in the model
(Qwen2-MoE's shared-expert gate) is reshaped. The llama architecture (Mixtral) stores q and k with
rows permuted for GGML's interleaved rotary embedding; `unpermute` restores the Hugging Face order,
the inverse of llama.cpp's ``LlamaModel.permute`` (as transformers' GGUF loader does). deepseek2
(`deepseek2`): the router's correction bias is ``exp_probs_b.bias``; ``kv_b_proj`` is ``attn_kv_b`` or
rebuilt exactly from the split ``attn_k_b`` / ``attn_v_b`` the current converter writes.

Routed experts: stacked ``[E, out, in]`` tensors ``blk.L.ffn_{gate,up,down}_exps.weight`` (or a
fused ``ffn_gate_up_exps``, gate rows first; or the old per-expert ``blk.L.ffn_gate.E.weight``),
optional biases ``ffn_*_exps.bias`` (gpt-oss). Each expert's slice keeps its precision class
(`quants.encoded_weight`); gate and up are fused into ``gate_up`` when they share a codec.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ...adapters.base import Adapter
from ...errors import CheckpointError
from ...ftw.codecs import EncodedTensor, decode, encode
from . import deepseek2
from .quants import encoded_weight
from .reader import GGUFSource, _gguf, dequantize


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of q/k rows: ``[n_head * 2 * d, ...]`` rows grouped as
    (head, d, 2) in GGUF -> (head, 2, d) as Hugging Face has them. `n_head`: query heads for q,
    key/value heads for k."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class TensorMap:
    """Engine parameter names -> float tensors read from `src` (see the module doc)."""

    def __init__(self, src: GGUFSource, adapter: Adapter, config: dict) -> None:
        gguf = _gguf()
        arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[src.arch]
        self.src, self.adapter, self.config = src, adapter, config
        self.names = gguf.get_tensor_name_map(arch_id, config["num_hidden_layers"])

    def gguf_name(self, name: str) -> str:
        """The GGUF tensor behind engine parameter `name`; CheckpointError when none is known."""
        parts = name.split(".")
        if name.endswith("self_attn.sinks"):
            return f"blk.{parts[1]}.attn_sinks.weight"
        if name.endswith("router.e_score_correction_bias"):
            return f"blk.{parts[1]}.exp_probs_b.bias"
        hf = self.adapter.hf_name(name)
        base, suffix = hf.rsplit(".", 1)
        mapped = self.names.get_name(base)
        if mapped is None:
            raise CheckpointError(f"{self.src.path}: no GGUF tensor is known for the model's '{hf}'")
        gname = f"{mapped}.{suffix}"
        if gname == "output.weight" and not self.src.has(gname):
            return "token_embd.weight"  # tied embeddings: llama.cpp writes no output.weight
        return gname

    def dense(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Engine parameter `name` of `shape` as a float tensor (float32, bf16 for BF16 data)."""
        gname = self.gguf_name(name)
        if gname.endswith("attn_kv_b.weight") and deepseek2.has_split_kv_b(self.src, int(name.split(".")[1])):
            t = deepseek2.kv_b(self.src, int(name.split(".")[1]), self.config)
        else:
            t = self.src.float_tensor(gname)
        if tuple(t.shape) != tuple(shape):
            if t.numel() != torch.Size(shape).numel():
                raise CheckpointError(
                    f"{self.src.path}: tensor '{gname}' has shape {list(t.shape)}, "
                    f"the model needs {list(shape)}"
                )
            t = t.reshape(shape)
        if self.src.arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.config["num_attention_heads"]
            if "attn_k" in gname:
                heads = self.config["num_key_value_heads"]
            t = unpermute(t, heads)
        return t


def layer_experts(
    src: GGUFSource, layer: int, num_experts: int
) -> Iterator[tuple[int, dict[str, EncodedTensor]]]:
    """(expert id, projections in their kept codecs) for every routed expert of `layer`."""
    blk = f"blk.{layer}"
    fused = src.tensors.get(f"{blk}.ffn_gate_up_exps.weight")
    per_expert = src.has(f"{blk}.ffn_gate.0.weight")
    if fused is None and not per_expert:
        stacks = [src.tensor(f"{blk}.ffn_{w}_exps.weight") for w in ("gate", "up", "down")]
        for t in stacks:
            if t.shape[0] != num_experts:
                raise CheckpointError(
                    f"{src.path}: '{t.name}' holds {t.shape[0]} experts, the metadata says {num_experts}"
                )
    biases = _biases(src, blk)
    for e in range(num_experts):
        if per_expert:
            gate, up, down = (
                encoded_weight(src.tensor(f"{blk}.ffn_{w}.{e}.weight"), src.path)
                for w in "gate up down".split()
            )
        elif fused is not None:
            both = encoded_weight(fused, src.path, e)
            gate, up = _split_rows(both)
            down = encoded_weight(src.tensor(f"{blk}.ffn_down_exps.weight"), src.path, e)
        else:
            gate, up, down = (encoded_weight(t, src.path, e) for t in stacks)
        block = _gate_up(gate, up)
        block["down"] = down
        if biases is not None:
            gate_b, up_b, down_b = (dequantize(t, src.path, e) for t in biases)
            block["gate_up_bias"] = _plain(torch.cat([gate_b, up_b]))
            block["down_bias"] = _plain(down_b)
        yield e, block


def _biases(src: GGUFSource, blk: str) -> tuple | None:
    if src.has(f"{blk}.ffn_gate_up_exps.bias"):
        raise CheckpointError(f"{src.path}: fused gate/up expert biases are not supported")
    names = [f"{blk}.ffn_{w}_exps.bias" for w in ("gate", "up", "down")]
    if not any(src.has(n) for n in names):
        return None
    return tuple(src.tensor(n) for n in names)


def _plain(t: torch.Tensor) -> EncodedTensor:
    return encode(t, "bf16" if t.dtype == torch.bfloat16 else "fp32")


def _gate_up(gate: EncodedTensor, up: EncodedTensor) -> dict[str, EncodedTensor]:
    """One ``gate_up`` (rows of gate, then of up) when both share a codec (every codec here is
    row-wise, so the parts concatenate exactly), else ``gate`` and ``up`` apart (also when their
    shapes differ: a garbled file, which the converter's shape check then names)."""
    if gate.codec != up.codec or set(gate.parts) != set(up.parts) or gate.shape != up.shape:
        return {"gate": gate, "up": up}
    parts = {k: torch.cat([gate.parts[k], up.parts[k]], dim=0) for k in gate.parts}
    return {"gate_up": EncodedTensor(gate.codec, (gate.shape[0] + up.shape[0], gate.shape[1]), parts)}


def _split_rows(enc: EncodedTensor) -> tuple[EncodedTensor, EncodedTensor]:
    half = enc.shape[0] // 2
    first = {k: v[:half].contiguous() for k, v in enc.parts.items()}
    second = {k: v[half:].contiguous() for k, v in enc.parts.items()}
    shape = (half, enc.shape[1])
    return EncodedTensor(enc.codec, shape, first), EncodedTensor(enc.codec, shape, second)


def float_block(block: dict[str, EncodedTensor]) -> dict[str, torch.Tensor]:
    """A block's weights decoded to float32 (for re-encoding under an explicit ``--quant``)."""
    return {name: decode(enc, torch.float32) for name, enc in block.items()}
