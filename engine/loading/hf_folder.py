"""Loading a Hugging Face checkpoint folder (config.json + *.safetensors [+ tokenizer files]):
the spec and the dense model first (`load_hf_dense`), the routed experts into RAM only when the
composition root keeps them resident (`load_hf_experts`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from ..adapters import adapter_for
from ..adapters.base import Adapter
from ..checkpoint import SafetensorsCheckpoint, config_from_dict, read_config
from ..errors import CheckpointError
from ..model.dense import load_dense_weights
from ..model.experts import ExpertKey, ExpertWeights
from ..model.transformer import MoETransformer
from ..spec import ModelSpec
from ..spec_checks import check_layer_count
from ..text.tokenizer_files import TOKENIZER_MARKERS

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class HFDense:
    """A checkpoint folder opened, with its dense weights assigned to `model`."""

    folder: Path
    spec: ModelSpec
    model: MoETransformer
    hf_config: PretrainedConfig
    adapter: Adapter
    checkpoint: SafetensorsCheckpoint


@dataclass(frozen=True)
class HFCheckpoint:
    """A checkpoint folder opened: its raw config.json, the transformers config, the adapter of
    its architecture, the spec it builds, and its memory-mapped safetensors."""

    raw: dict[str, Any]
    hf_config: PretrainedConfig
    adapter: Adapter
    spec: ModelSpec
    checkpoint: SafetensorsCheckpoint


def open_hf_checkpoint(folder: Path) -> HFCheckpoint:
    """Read `folder`'s config and open its safetensors (what loading and conversion start from).
    CheckpointError for a missing or garbled config, a hyper-parameter out of range or at odds
    with the others or with the layers the tensors hold (`spec_checks`), UnsupportedModelError
    for an unknown model_type."""
    raw = read_config(folder)  # hyper-parameters type- and range-checked (`spec_checks`)
    adapter = adapter_for(raw["model_type"])
    where = str(folder / "config.json")
    hf_config = config_from_dict(raw, where)
    checkpoint = SafetensorsCheckpoint(folder)
    # A layer count off the tensors would load a truncated model that answers, or fail late.
    # DeepSeek's multi-token-prediction layers (eh_proj) follow the model's layers: not counted.
    names = checkpoint.names()
    mtp = {m[1] for name in names if (m := _LAYER.match(name)) and name.endswith(".eh_proj.weight")}
    found = {int(m[1]) for name in names if (m := _LAYER.match(name)) and m[1] not in mtp}
    check_layer_count(
        where, "num_hidden_layers", hf_config.num_hidden_layers, found, "model.layers.N.* tensors"
    )
    return HFCheckpoint(raw, hf_config, adapter, adapter.build_spec(hf_config, where), checkpoint)


def load_hf_dense(folder: Path, dtype: torch.dtype, device: str) -> HFDense:
    """Read the config, build the model and assign its dense weights. CheckpointError for
    missing/garbled files or tensors, UnsupportedModelError for an unknown model_type."""
    opened = open_hf_checkpoint(folder)
    adapter, hf_config, spec, ckpt = opened.adapter, opened.hf_config, opened.spec, opened.checkpoint
    model = MoETransformer(spec)
    load_dense_weights(model, lambda name: adapter.dense_tensor(ckpt, name), str(folder), dtype, device)
    return HFDense(folder, spec, model, hf_config, adapter, ckpt)


def iter_hf_experts(hf: HFDense) -> Iterator[tuple[ExpertKey, dict[str, torch.Tensor]]]:
    """Every routed expert's canonical tensors (shape-checked), layer by layer."""
    for layer in hf.spec.moe_layers():
        moe = hf.spec.layers[layer].moe
        assert moe is not None
        for e, tensors in hf.adapter.layer_experts(hf.checkpoint, layer, moe.num_experts):
            _check_expert_shapes(tensors, moe.intermediate_size, hf.spec.hidden_size, layer, e, hf.folder)
            yield (layer, e), tensors


def load_hf_experts(
    hf: HFDense, dtype: torch.dtype, device: str, *, int8: bool
) -> dict[ExpertKey, ExpertWeights]:
    """Every routed expert packed in `dtype` on `device` (int8 projections with `int8`)."""
    if int8:
        return {key: ExpertWeights.quantized(t, dtype, device) for key, t in iter_hf_experts(hf)}
    return {key: ExpertWeights.packed(t, dtype, device) for key, t in iter_hf_experts(hf)}


def expert_source_dtype(hf: HFDense) -> torch.dtype | None:
    """The dtype the checkpoint stores its first expert's weights in (None without experts)."""
    for _key, tensors in iter_hf_experts(hf):
        return tensors["gate_up"].dtype
    return None


def _check_expert_shapes(
    tensors: dict[str, torch.Tensor], inter: int, hidden: int, layer: int, expert: int, folder: Path
) -> None:
    expected = {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(
                f"expert {expert} of layer {layer} in {folder}: '{name}' has shape "
                f"{list(tensors[name].shape)}, expected {list(shape)}"
            )


def load_hf_tokenizer(folder: Path) -> tuple[Any | None, str | None]:
    """(tokenizer, None), or (None, why) when the folder has no tokenizer files or they cannot
    be loaded: the engine then still runs on token ids and raises EngineError when text is
    needed (a broken tokenizer file must not make the weights unusable)."""
    if not any((folder / f).exists() for f in TOKENIZER_MARKERS):
        return None, f"checkpoint {folder} has no tokenizer files"
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder), None
    except Exception as e:  # noqa: BLE001 - tokenizers fail in many ways (OSError, ValueError, JSON...)
        why = f"the tokenizer in {folder} cannot be loaded ({type(e).__name__}: {e})"
        logger.warning("%s; loading for token-id use only", why)
        return None, why
