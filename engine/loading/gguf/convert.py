"""Convert a GGUF file (llama.cpp / Ollama weights) into one FTW file (`freetoken convert x.gguf`).

What goes into the file (see `engine/gguf/__init__.py` for the whole mapping):

- ``model_config``: the Hugging Face config the metadata describes (`config.hf_config`); the
  GGUF's own metadata summary (architecture, file type, tensor types) under the manifest metadata.
- tokenizer files built from ``tokenizer.ggml.*`` and the chat template, and a
  generation_config.json with the end-of-generation ids (`tokenizer.tokenizer_files`).
- dense tensors under the engine's names, dequantized: float32, or bfloat16 where the GGUF tensor
  is BF16 (both exact); ``dense_dtype`` casts them instead (the engine's fp32 parameters stay fp32).
- one block per routed expert. ``quant="source"`` (the default) keeps each weight's precision
  class with its exact values (`quants`): Q8_0 -> int8_b32, Q4_0/Q4_1/Q4_K -> uint4_b32, MXFP4 ->
  mxfp4, BF16 -> bf16, any other type -> fp32 (dequantized). Any ``QUANT_CODECS`` name re-encodes
  every expert weight from its float32 values instead. Biases are stored exactly (fp32 or bf16).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ...adapters import adapter_for
from ...checkpoint import config_from_dict
from ...errors import CheckpointError
from ...ftw.writer import FTWWriter
from ...model.expert_tensors import WEIGHT_NAMES
from ...model.transformer import MoETransformer
from ...spec import ModelSpec, MoESpec
from ..convert import QUANT_CODECS, ConvertReport, _encode_weight, _report
from .config import hf_config
from .reader import GGUFSource
from .tensors import TensorMap, float_block, layer_experts
from .tokenizer import tokenizer_files

logger = logging.getLogger(__name__)

SOURCE = "source"
GGUF_QUANTS: tuple[str, ...] = (SOURCE, *QUANT_CODECS)
"""``quant`` values for a GGUF source: keep each weight's precision class, or one codec for all."""


def convert_gguf(
    gguf_path: str | Path,
    out_path: str | Path,
    *,
    quant: str = SOURCE,
    compress: bool = False,
    progress: bool = True,
    dense_dtype: torch.dtype | None = None,
) -> ConvertReport:
    """Write the GGUF model `gguf_path` (any part of a split GGUF) as the FTW file `out_path`.

    Raises CheckpointError (garbled, truncated or incomplete file, undecodable tensor type) /
    UnsupportedModelError (architecture) naming the file; ValueError for a bad argument. The file
    appears atomically: on error nothing is left at `out_path`.
    """
    t0 = time.perf_counter()
    out = Path(out_path)
    if quant not in GGUF_QUANTS:
        raise ValueError(
            f"unknown quant {quant!r} for a GGUF source; expected one of {', '.join(GGUF_QUANTS)}"
        )
    if out.is_dir():
        raise ValueError(f"output path {out} is a folder; give a file name such as model.ftw")
    if dense_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dense_dtype must be float32, bfloat16 or float16, got {dense_dtype}")
    src = GGUFSource(gguf_path)
    config = hf_config(src)
    adapter = adapter_for(config["model_type"])
    spec = adapter.build_spec(config_from_dict(config))
    types = Counter(t.type_name for t in src.tensors.values())
    metadata: dict[str, Any] = {
        "converter": "freetoken-agents",
        "source": src.path.name,
        "source_format": "gguf",
        "gguf_architecture": src.arch,
        "gguf_tensor_types": dict(sorted(types.items())),
        "quant": quant,
        "dense_dtype": "source" if dense_dtype is None else str(dense_dtype).removeprefix("torch."),
        "compress": compress,
    }
    files = tokenizer_files(src)
    stats: Counter[str] = Counter()
    moe_layers = spec.moe_layers()
    total = sum(spec.layers[i].moe.num_experts for i in moe_layers)  # type: ignore[union-attr]
    with FTWWriter(out, model_config=config, tokenizer_files=files, metadata=metadata) as w:
        _write_dense(w, TensorMap(src, adapter, config), spec, dense_dtype)
        bar = tqdm(total=total, desc=f"convert {src.path.name}", unit="expert", disable=not progress)
        with bar:
            for layer in moe_layers:
                moe = spec.layers[layer].moe
                assert moe is not None
                for e, block in layer_experts(src, layer, moe.num_experts):
                    _check_expert(src.path, layer, e, block, moe, spec.hidden_size)
                    if quant != SOURCE:
                        block = _reencoded(block, QUANT_CODECS[quant], stats, (layer, e))
                    w.add_expert(layer, e, block, compress=compress)
                    bar.update(1)
    report = _report(out, src.path.parent, quant, stats, None, time.perf_counter() - t0)
    report = dataclasses.replace(report, source_bytes=sum(p.stat().st_size for p in src.parts))
    logger.info("%s", report.summary())
    return report


def _write_dense(w: FTWWriter, tensors: TensorMap, spec: ModelSpec, dense_dtype: torch.dtype | None) -> None:
    """Every dense parameter/buffer under its engine name (dtype policy: module doc)."""
    model = MoETransformer(spec)  # meta tensors: only names and shapes
    keep_fp32 = model.fp32_parameter_names()
    for name, param in [*model.named_parameters(), *model.named_buffers()]:
        t = tensors.dense(name, tuple(param.shape))
        if dense_dtype is not None and t.is_floating_point():
            t = t.to(torch.float32 if name in keep_fp32 else dense_dtype)
        w.add_dense(name, t.contiguous())


def _check_expert(where: Path, layer: int, e: int, block: dict, moe: MoESpec, hidden: int) -> None:
    """CheckpointError when expert `e`'s tensors do not have the shapes the metadata gives the model
    (a tensor directory that disagrees with the metadata): caught while converting, rather than
    written to a file every later load rejects (the FTW loader's `check_expert_directory` rule)."""
    i = moe.intermediate_size
    want: dict[str, tuple[int, ...]] = {"down": (hidden, i)}
    want |= {"gate": (i, hidden), "up": (i, hidden)} if "gate" in block else {"gate_up": (2 * i, hidden)}
    if moe.expert_bias:
        want |= {"gate_up_bias": (2 * i,), "down_bias": (hidden,)}
    got = {name: tuple(t.shape) for name, t in block.items()}
    if got != want:
        raise CheckpointError(
            f"{where}: the tensors of layer {layer}'s expert {e} have shapes {got}, "
            f"the metadata makes the model need {want}"
        )


def _reencoded(block: dict, codec: str, stats: Counter[str], key: tuple[int, int]) -> dict:
    """Expert weights decoded to float32 and encoded in `codec` (biases kept as they are)."""
    floats = float_block({n: t for n, t in block.items() if n in WEIGHT_NAMES})
    if "gate" in floats:
        floats = {"gate_up": torch.cat([floats.pop("gate"), floats.pop("up")]), **floats}
    out = {name: _encode_weight(t, codec, stats, key, name) for name, t in floats.items()}
    return {**out, **{n: t for n, t in block.items() if n not in WEIGHT_NAMES}}
