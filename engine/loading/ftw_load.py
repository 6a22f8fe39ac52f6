"""Build an engine's parts from an FTW file (`Engine.from_pretrained("model.ftw")` calls `load_ftw`).

An FTW file is self-contained: the spec comes from the embedded Hugging Face config, dense tensors
are stored under the engine's own parameter names (no name mapping), experts are served lazily by
`FTWExpertProvider`, and the tokenizer is rebuilt from the embedded files.

Opening checks everything that is cheap to check before a single expert byte is read: the header
and manifest (in `FTWFile`), every dense tensor's checksum, and that the expert directory holds
exactly the experts the config describes with the shapes the model needs. Expert blocks are
verified when they are first read.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from ..adapters import adapter_for
from ..adapters.base import dequantized
from ..checkpoint import config_from_dict
from ..errors import CheckpointError, FTWFormatError
from ..ftw.reader import FTWFile
from ..kernels.int8 import ExpertQuant, check_expert_quant
from ..model.dense import load_dense_weights
from ..model.transformer import MoETransformer
from ..spec import ModelSpec
from ..text.tokenizer_files import TOKENIZER_MARKERS
from .ftw_provider import FTWExpertProvider

logger = logging.getLogger(__name__)


@dataclass
class LoadedFTW:
    """What `Engine.__init__` needs, built from one FTW file."""

    spec: ModelSpec
    model: MoETransformer
    experts: FTWExpertProvider
    tokenizer: Any | None
    hf_config: PretrainedConfig
    ftw: FTWFile
    tokenizer_error: str | None = None  # why `tokenizer` is None (token-id use only)


def load_ftw(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    expert_quant: ExpertQuant = "auto",
) -> LoadedFTW:
    """Open `path` and build spec, model (dense weights assigned), lazy experts and tokenizer.

    ``expert_quant`` (`int8.EXPERT_QUANTS`): which expert projections the provider keeps in int8
    (default ``"auto"``: those stored in the int8 codec); EngineError for an unknown value.

    Raises CheckpointError when `path` does not exist or is a folder; FTWFormatError (naming file,
    block and offset) for a truncated, corrupted or foreign file, a missing or misshapen expert or
    dense tensor, or an expert index outside the config's range; UnsupportedModelError for an
    unknown model_type. On error the file is closed and nothing is returned half-loaded.
    """
    path = Path(path)
    expert_quant = check_expert_quant(expert_quant)  # a public entry point: checked before reading
    if not path.exists():
        raise CheckpointError(f"FTW file {path} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file (an FTW model is one .ftw file)")
    t0 = time.perf_counter()
    ftw = FTWFile(path)
    try:
        cfg = ftw.model_config
        if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
            raise FTWFormatError(f"{ftw.path}: the manifest's model_config has no 'model_type'")
        adapter = adapter_for(cfg["model_type"])
        try:
            hf_config = config_from_dict(cfg)
            spec = adapter.build_spec(hf_config)
        except (AttributeError, ValueError, KeyError, TypeError) as e:
            raise FTWFormatError(
                f"{ftw.path}: cannot build the model from the manifest's config: {e!r}"
            ) from e
        model = MoETransformer(spec)
        names = set(ftw.dense_names())

        def get(name: str) -> torch.Tensor:
            if name not in names:
                raise FTWFormatError(f"{ftw.path}: no dense tensor named {name!r} (the model needs it)")
            return ftw.dense(name, verify=True)

        load_dense_weights(
            model, lambda name: dequantized(name, get, names.__contains__, ftw.path), ftw.path, dtype, device
        )
        check_expert_directory(ftw, spec)
        experts = FTWExpertProvider(ftw, dtype, device, expert_quant)
        tokenizer_error = None
        try:
            tokenizer = load_embedded_tokenizer(ftw)
        except CheckpointError as e:  # the weights stay usable on token ids
            tokenizer, tokenizer_error = None, str(e)
            logger.warning("%s; loading for token-id use only", e)
        if tokenizer is None and tokenizer_error is None:
            tokenizer_error = f"{ftw.path} embeds no tokenizer"
    except BaseException:
        ftw.close()
        raise
    logger.info(
        "opened %s (%s, %d expert blocks) in %.2fs",
        ftw.path,
        spec.model_type,
        len(ftw.expert_keys()),
        time.perf_counter() - t0,
    )
    return LoadedFTW(spec, model, experts, tokenizer, hf_config, ftw, tokenizer_error)


def check_expert_directory(ftw: FTWFile, spec: ModelSpec) -> None:
    """FTWFormatError unless the file has exactly the spec's routed experts with the right shapes.

    Reads only the manifest. Expected projections: ``gate_up [2I, H]`` or ``gate``/``up`` ``[I, H]``,
    ``down [H, I]``, and ``gate_up_bias [2I]``, ``down_bias [H]`` exactly when the spec has expert
    biases.
    """
    h = spec.hidden_size
    wanted: dict[tuple[int, int], Any] = {}
    for layer in spec.moe_layers():
        moe = spec.layers[layer].moe
        assert moe is not None
        for e in range(moe.num_experts):
            wanted[(layer, e)] = moe
    for key in ftw.expert_keys():
        if key not in wanted:
            info = ftw.expert_info(*key)
            raise FTWFormatError(
                f"{ftw.path}: expert block (layer={key[0]}, expert={key[1]}) at byte offset {info.offset}: "
                f"index out of range for this model (MoE layers {spec.moe_layers()}, experts per layer "
                f"{sorted({m.num_experts for m in wanted.values()})})"
            )
    for (layer, e), moe in wanted.items():
        info = ftw.expert_info(layer, e)  # FTWFormatError naming the block if it is missing
        i = moe.intermediate_size
        shapes = {"down": (h, i)}
        shapes |= {"gate": (i, h), "up": (i, h)} if "gate" in info.tensors else {"gate_up": (2 * i, h)}
        if moe.expert_bias:
            shapes |= {"gate_up_bias": (2 * i,), "down_bias": (h,)}
        got = {name: tuple(t.shape) for name, t in info.tensors.items()}
        if got != shapes:
            raise FTWFormatError(
                f"{ftw.path}: expert block (layer={layer}, expert={e}) at byte offset {info.offset}: "
                f"projections {got} do not match the model, which needs {shapes}"
            )


def load_embedded_tokenizer(ftw: FTWFile) -> Any | None:
    """The tokenizer rebuilt from the file's embedded tokenizer files (None if it has none).

    The files are written to a temporary folder and loaded with `AutoTokenizer.from_pretrained`,
    exactly as from the source checkpoint folder. CheckpointError if they do not make a tokenizer.
    """
    files = ftw.tokenizer_files
    if not any(name in files for name in TOKENIZER_MARKERS):
        return None
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="ftw-tokenizer-") as tmp:
        # config.json lets AutoTokenizer resolve the class when tokenizer_config.json does not say.
        (Path(tmp) / "config.json").write_text(json.dumps(ftw.model_config))
        for name, data in files.items():
            if Path(name).name != name or name in ("", ".", ".."):
                raise FTWFormatError(f"{ftw.path}: embedded tokenizer file name {name!r} is not a plain name")
            (Path(tmp) / name).write_bytes(data)
        try:
            return AutoTokenizer.from_pretrained(tmp)
        except (OSError, ValueError, TypeError) as e:
            raise CheckpointError(f"cannot load the tokenizer embedded in {ftw.path}: {e}") from e
