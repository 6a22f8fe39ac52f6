"""Convert a Hugging Face checkpoint folder into one FTW file (`freetoken convert`).

What goes into the file:

- ``model_config``: the checkpoint's config.json dict, verbatim except ``quantization_config``
  (the FTW codecs describe the stored quantization; the source's entry is kept in the metadata
  as ``source_quantization_config``).
- tokenizer files (`EMBEDDED_FILES`) that exist in the folder, byte for byte.
- dense tensors under the ENGINE's parameter names (the names `MoETransformer` uses, so loading
  needs no name mapping). Dtype policy:
    * float tensors are stored in ``dense_dtype``: float32 for ``quant="fp32"``, else bfloat16 by
      default (the compute dtype of real MoE checkpoints; half the bytes of fp32);
    * the parameters the engine always keeps in fp32 (DeepSeek-V3's router weight and score
      correction bias, `MoETransformer.fp32_parameter_names`) are stored in float32;
    * fp8 block-quantized weights (DeepSeek-V3 ``float8_e4m3fn`` + ``weight_scale_inv``) are carried
      over as stored, the grid under ``<name>_scale_inv`` (float32), unless ``quant="fp32"``, which
      dequantizes them exactly to fp32. The loader dequantizes them like the HF-folder path.
- one block per routed expert: the canonical projections (``gate_up [2I, H]`` gate rows first,
  ``down [H, I]``) in the expert's codec, biases (``gate_up_bias [2I]``, ``down_bias [H]``) in
  ``"fp32"`` when ``dense_dtype`` is float32 and in ``"bf16"`` otherwise. Already-quantized experts
  whose codec is the target codec are carried over without decoding: gpt-oss MXFP4 blocks/scales
  (rows de-interleaved, lossless) and DeepSeek-V3 fp8 weights (stored as separate ``gate``/``up``
  projections, see `Adapter.layer_experts_encoded`). A weight a codec cannot represent (MXFP4 needs
  the input dim to be a multiple of 32) is stored in `FALLBACK_CODEC` with a warning.

Quant modes (`QUANTS`): ``fp32 | bf16 | fp8 | int8 | mxfp4 | int8_b32 | uint4_b32`` apply one codec
to every expert; ``auto`` measures routing frequency (`calibrate.py`) and stores each layer's
hottest experts in ``AutoPolicy.hot_codec`` and the rest in ``AutoPolicy.cold_codec``. The policy,
the measured selection counts and the hot sets are recorded in the manifest metadata under
``"auto"``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..adapters.base import FP8_SCALE_SUFFIX, Adapter, fp8_encoded
from ..checkpoint import SafetensorsCheckpoint
from ..choices import QUANT_CODECS, QUANTS
from ..errors import CheckpointError
from ..ftw.codecs import EncodedTensor, decode, encode, get_codec
from ..ftw.reader import FTWFile
from ..ftw.writer import FTWWriter
from ..model.expert_tensors import WEIGHT_NAMES
from ..model.transformer import MoETransformer
from ..spec import ModelSpec, MoESpec
from ..text.stop_tokens import GENERATION_CONFIG
from ..text.tokenizer_files import TOKENIZER_FILES
from .calibrate import AutoPolicy, CalibrationModel, OpenForCalibration, hot_experts, measure_routing
from .hf_folder import open_hf_checkpoint

logger = logging.getLogger(__name__)

EMBEDDED_FILES: tuple[str, ...] = (*TOKENIZER_FILES, GENERATION_CONFIG)
"""Files copied from the checkpoint folder into the manifest when present."""
FALLBACK_CODEC = "bf16"
"""Codec used for a weight the requested codec cannot represent."""
_BIASES = ("gate_up_bias", "down_bias")


@dataclass
class ConvertReport:
    """What `convert_checkpoint` wrote. Sizes in bytes.

    Attributes:
        path: the FTW file.
        quant: the quant mode.
        file_bytes: size of the FTW file.
        source_bytes: total size of the source ``*.safetensors`` files.
        dense_tensors / dense_bytes: number and raw size of the dense tensors.
        expert_blocks / expert_bytes: number of expert blocks and their size on disk (block headers
            + stored bytes, no alignment padding).
        codec_counts: expert weight projections (``gate_up``/``gate``/``up``/``down``) per codec.
        bias_codec_counts: expert bias projections per codec.
        carried_over: expert weight projections stored exactly as the source stored them.
        fallbacks: weights stored in `FALLBACK_CODEC` because the requested codec could not
            represent them.
        hot_experts: ``auto`` only: ``{layer: hot expert ids}``.
        seconds: wall time of the conversion (calibration included).
    """

    path: Path
    quant: str
    file_bytes: int
    source_bytes: int
    dense_tensors: int
    dense_bytes: int
    expert_blocks: int
    expert_bytes: int
    codec_counts: dict[str, int] = field(default_factory=dict)
    bias_codec_counts: dict[str, int] = field(default_factory=dict)
    carried_over: int = 0
    fallbacks: int = 0
    hot_experts: dict[int, list[int]] | None = None
    seconds: float = 0.0

    @property
    def ratio(self) -> float:
        """FTW file size / source checkpoint size."""
        return self.file_bytes / self.source_bytes if self.source_bytes else float("nan")

    def summary(self) -> str:
        """One line: file, bytes, codecs of the expert weights and the ratio to the source.

        The codec counts are per weight projection (a block holds 2 or 3: ``gate_up``/``down``, or
        ``gate``/``up``/``down``), so they are labelled with their own total: put next to the
        block count unlabelled they did not add up to it (issue 65)."""
        codecs = ", ".join(f"{c} x{n}" for c, n in sorted(self.codec_counts.items()))
        extra = f", {self.carried_over} carried over" if self.carried_over else ""
        projections = sum(self.codec_counts.values())
        return (
            f"wrote {self.path}: {self.file_bytes:,} bytes ({self.ratio:.2f}x of {self.source_bytes:,} "
            f"source bytes), quant {self.quant}, {self.expert_blocks} expert blocks "
            f"({projections} weight projections: {codecs or 'none'}{extra}), "
            f"{self.dense_tensors} dense tensors ({self.dense_bytes:,} bytes), {self.seconds:.1f}s"
        )


def convert_checkpoint(
    hf_dir: str | Path,
    out_path: str | Path,
    *,
    quant: str = "bf16",
    compress: bool = False,
    progress: bool = True,
    auto_policy: AutoPolicy | None = None,
    dense_dtype: torch.dtype | None = None,
    calibration_device: str = "cpu",
    open_model: OpenForCalibration | None = None,
    extra_metadata: Mapping[str, Any] | None = None,
) -> ConvertReport:
    """Write the Hugging Face checkpoint in `hf_dir` as the FTW file `out_path` (see module doc).

    Args:
        quant: one of `QUANTS`.
        compress: zstd-compress every expert block.
        progress: show a tqdm bar over the experts.
        auto_policy: hot/cold split for ``quant="auto"`` (default `AutoPolicy()`); ignored otherwise.
        dense_dtype: override the dense float dtype policy (float32, bfloat16 or float16).
        calibration_device: where ``quant="auto"`` runs the model to measure routing ("cpu",
            "cuda" or "cuda:N"; on CUDA in bfloat16, placed by the engine's "auto" placement).
        open_model: loads the checkpoint to measure its routing for ``quant="auto"``
            (`Engine.for_calibration`); required then.
        extra_metadata: more entries for the file's free-form metadata (JSON-serialisable; the
            converter's own entries win).

    Raises CheckpointError / UnsupportedModelError for an unreadable or unsupported checkpoint,
    ValueError for a bad argument. The file appears atomically: on error nothing is left at
    `out_path` (an existing file there is kept).
    """
    t0 = time.perf_counter()
    folder, out = Path(hf_dir), Path(out_path)
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}; expected one of {', '.join(QUANTS)}")
    if quant == "auto" and open_model is None:
        raise ValueError(
            "quant 'auto' measures routing on the model: pass open_model (Engine.for_calibration)"
        )
    if out.is_dir():
        raise ValueError(f"output path {out} is a folder; give a file name such as model.ftw")
    if dense_dtype is None:
        dense_dtype = torch.float32 if quant == "fp32" else torch.bfloat16
    if dense_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dense_dtype must be float32, bfloat16 or float16, got {dense_dtype}")
    opened = open_hf_checkpoint(folder)
    raw, adapter, spec, ckpt = opened.raw, opened.adapter, opened.spec, opened.checkpoint

    metadata: dict[str, Any] = {
        **(extra_metadata or {}),
        "converter": "freetoken-agents",
        "source": folder.name,
        "quant": quant,
        "dense_dtype": str(dense_dtype).removeprefix("torch."),
        "compress": compress,
    }
    model_config = dict(raw)
    if "quantization_config" in model_config:
        metadata["source_quantization_config"] = model_config.pop("quantization_config")
    hot: dict[int, list[int]] | None = None
    policy = auto_policy or AutoPolicy()
    if quant == "auto":
        assert open_model is not None  # checked first thing
        hot = _calibrate(open_model(folder, calibration_device), policy, metadata)
    tokenizer_files = {n: (folder / n).read_bytes() for n in EMBEDDED_FILES if (folder / n).is_file()}

    stats: Counter[str] = Counter()
    total = sum(_moe(spec, i).num_experts for i in spec.moe_layers())
    with FTWWriter(out, model_config=model_config, tokenizer_files=tokenizer_files, metadata=metadata) as w:
        _write_dense(w, adapter, ckpt, spec, quant, dense_dtype)
        bias_codec = "fp32" if dense_dtype == torch.float32 else "bf16"
        bar = tqdm(total=total, desc=f"convert {folder.name}", unit="expert", disable=not progress)
        with bar:
            for layer, e, stored in _stored_experts(adapter, ckpt, spec):
                if hot is not None:
                    codec = policy.hot_codec if e in hot.get(layer, ()) else policy.cold_codec
                else:
                    codec = QUANT_CODECS[quant]
                w.add_expert(
                    layer, e, _encode_block(stored, codec, bias_codec, stats, (layer, e)), compress=compress
                )
                bar.update(1)
    report = _report(out, folder, quant, stats, hot, time.perf_counter() - t0)
    logger.info("%s", report.summary())
    return report


def _moe(spec: ModelSpec, layer: int) -> MoESpec:
    moe = spec.layers[layer].moe
    assert moe is not None
    return moe


def _report(
    out: Path, folder: Path, quant: str, stats: Counter[str], hot: dict[int, list[int]] | None, seconds: float
) -> ConvertReport:
    """Sizes and codec counts read back from the written file's manifest (no expert bytes read)."""
    with FTWFile(out) as f:
        infos = [f.expert_info(*k) for k in f.expert_keys()]
        dense = [f.dense_info(n) for n in f.dense_names()]
        tensors = [(n, t.codec) for info in infos for n, t in info.tensors.items()]
        file_bytes = f.file_size
    return ConvertReport(
        path=out,
        quant=quant,
        file_bytes=file_bytes,
        source_bytes=sum(p.stat().st_size for p in folder.glob("*.safetensors")),
        dense_tensors=len(dense),
        dense_bytes=sum(d.nbytes for d in dense),
        expert_blocks=len(infos),
        expert_bytes=sum(info.block_length for info in infos),
        codec_counts=dict(Counter(c for n, c in tensors if n not in _BIASES)),
        bias_codec_counts=dict(Counter(c for n, c in tensors if n in _BIASES)),
        carried_over=stats["carried"],
        fallbacks=stats["fallback"],
        hot_experts=hot,
        seconds=seconds,
    )


def _calibrate(model: CalibrationModel, policy: AutoPolicy, metadata: dict[str, Any]) -> dict[int, list[int]]:
    """Measure routing on the source checkpoint (`model`, closed here); record policy, counts and
    hot sets in `metadata`."""
    try:
        counts, tokens = measure_routing(model, policy)
    finally:
        model.close()
    hot = hot_experts(counts, policy.hot_fraction)
    metadata["auto"] = {
        "policy": policy.to_dict(),
        "calibration_tokens": tokens,
        "routing_counts": {str(k): v for k, v in counts.items()},
        "hot_experts": {str(k): v for k, v in hot.items()},
    }
    return hot


def _write_dense(
    w: FTWWriter,
    adapter: Adapter,
    ckpt: SafetensorsCheckpoint,
    spec: ModelSpec,
    quant: str,
    dense_dtype: torch.dtype,
) -> None:
    """Store every dense parameter/buffer under its engine name (dtype policy: module doc)."""
    model = MoETransformer(spec)  # meta tensors: only names and shapes
    keep_fp32 = model.fp32_parameter_names()
    for name, param in [*model.named_parameters(), *model.named_buffers()]:
        hf = adapter.hf_name(name)
        src = ckpt.get(hf)
        if tuple(src.shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor '{hf}' in {ckpt.folder} has shape {list(src.shape)}, expected {list(param.shape)}"
            )
        if src.dtype == torch.float8_e4m3fn and quant != "fp32":
            enc = fp8_encoded(hf, ckpt.get, ckpt.has, str(ckpt.folder))  # validates the scale grid
            items = [(name, enc.parts["weight"]), (name + FP8_SCALE_SUFFIX, enc.parts["scale_inv"])]
        else:
            t = adapter.dense_tensor(ckpt, name)
            if t.is_floating_point():
                t = t.to(torch.float32 if name in keep_fp32 else dense_dtype)
            items = [(name, t)]
        for item_name, t in items:
            w.add_dense(item_name, t)


def _stored_experts(
    adapter: Adapter, ckpt: SafetensorsCheckpoint, spec: ModelSpec
) -> Iterator[tuple[int, int, dict[str, EncodedTensor] | dict[str, torch.Tensor]]]:
    """(layer, expert, projections) for every routed expert: EncodedTensors as stored for
    pre-quantized checkpoints, canonical float tensors otherwise."""
    for layer in spec.moe_layers():
        moe = _moe(spec, layer)
        floats = None
        for e, enc in adapter.layer_experts_encoded(ckpt, layer, moe.num_experts):
            if enc is not None:
                yield layer, e, enc
                continue
            if floats is None:
                floats = adapter.layer_experts(ckpt, layer, moe.num_experts)
            fe, tensors = next(floats)
            if fe != e:  # adapters yield experts in order; anything else is a bug
                raise RuntimeError(f"adapter yielded expert {fe} where {e} was expected")
            yield layer, e, tensors


def _encode_block(
    stored: dict[str, EncodedTensor] | dict[str, torch.Tensor],
    codec: str,
    bias_codec: str,
    stats: Counter[str],
    key: tuple[int, int],
) -> dict[str, EncodedTensor]:
    """One expert's block: weights in `codec` (carried over when already in it), biases in `bias_codec`."""
    weights = {n: t for n, t in stored.items() if n in WEIGHT_NAMES}
    biases = {n: t for n, t in stored.items() if n in _BIASES}
    block: dict[str, EncodedTensor] = {}
    if weights and all(isinstance(t, EncodedTensor) and t.codec == codec for t in weights.values()):
        block.update(weights)  # type: ignore[arg-type]
        stats["carried"] += len(weights)
    else:
        floats = {n: decode(t) if isinstance(t, EncodedTensor) else t for n, t in weights.items()}
        if "gate" in floats:  # re-encoding: store the canonical fused gate_up
            floats = {"gate_up": torch.cat([floats.pop("gate"), floats.pop("up")], dim=0), **floats}
        for name, t in floats.items():
            block[name] = _encode_weight(t, codec, stats, key, name)
    for name, t in biases.items():
        f = decode(t) if isinstance(t, EncodedTensor) else t
        block[name] = encode(f, bias_codec)
    return block


def _encode_weight(
    t: torch.Tensor, codec: str, stats: Counter[str], key: tuple[int, int], name: str
) -> EncodedTensor:
    try:
        get_codec(codec).part_specs(tuple(t.shape))
    except ValueError as e:
        logger.warning("expert %s %s: %s; storing it as %s", key, name, e, FALLBACK_CODEC)
        stats["fallback"] += 1
        codec = FALLBACK_CODEC
    return encode(t.contiguous(), codec)
