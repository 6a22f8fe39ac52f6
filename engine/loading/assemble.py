"""The composition root: the one place the parts of an `Engine` are put together
(`Engine.from_pretrained` builds the engine from them).

    options -> device checked -> dense model loaded (HF folder or FTW file)
            -> placement resolved (`placement.resolve_placement`: "auto" made concrete)
            -> expert store built: resident (all experts in RAM/VRAM, or lazily from an FTW
               file) or tiered (`memory.TieredExpertProvider` over an FTW file: the file given,
               or the cached conversion of the HF folder, `cache`)
            -> wrapped in a `routing_record.RoutingRecorder` when `record_routing` names a trace
               file (its path is checked first, before anything is loaded)
            -> `LoadedModel`: what `Engine(...)` takes; it builds the KV pool (with the store's
               resize callback), the model fingerprint and the anchor store, and hands the
               recorder's `begin_step` to its sessions (`on_forward`).

Collaborators get what they need through their constructors (the tiered provider: routers for
pre-gating and the attention modules it times); nothing is patched on afterwards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from ..errors import CheckpointError, EngineError
from ..kernels.int8 import DenseQuantPart, ExpertQuant, quantize_dense
from ..memory import MemoryBudget, TieredExpertProvider
from ..memory.budget import free_host_bytes
from ..memory.routing_record import RoutingRecorder, check_trace_path
from ..memory.routing_trace import RoutingTraceError, iter_steps, read_trace
from ..model.experts import ExpertStore, InMemoryExpertProvider
from ..model.moe import MoEBlock
from ..model.transformer import MoETransformer
from ..options import EngineOptions
from ..spec import ModelSpec
from ..text.stop_tokens import read_generation_eos
from .cache import cached_ftw, lossless_quant
from .calibrate import OpenForCalibration
from .ftw_load import load_ftw
from .gguf.reader import is_gguf_path
from .hf_folder import expert_source_dtype, load_hf_dense, load_hf_experts, load_hf_tokenizer
from .placement import (
    PlacementChoice,
    check_device,
    expert_bytes,
    free_fast_bytes,
    resolve_placement,
    tiered_budget,
)

logger = logging.getLogger(__name__)


def is_ftw_path(path: Path) -> bool:
    """Whether `path` names an FTW file (an existing file, or a missing path ending in .ftw)."""
    return path.is_file() or (path.suffix == ".ftw" and not path.exists())


@dataclass(frozen=True)
class LoadedModel:
    """The parts of a loaded model, as `Engine.__init__` takes them (`Engine(**parts.as_kwargs())`)."""

    spec: ModelSpec
    model: MoETransformer
    experts: ExpertStore
    tokenizer: Any | None
    tokenizer_error: str | None
    hf_config: PretrainedConfig | None
    dtype: torch.dtype
    device: str
    memory: MemoryBudget | None
    source: Path
    placement: PlacementChoice
    on_kv_resize: Callable[[int], None] | None
    on_forward: Callable[[str, int, int], None] | None
    expert_quant: ExpertQuant
    dense_quant: Sequence[DenseQuantPart]
    generation_eos: int | list[int] | None
    cuda_graphs: bool

    def as_kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def assemble(path: str | Path, options: EngineOptions, open_model: OpenForCalibration) -> LoadedModel:
    """Load the parts of the engine for `path` (an HF checkpoint folder, an FTW or GGUF file)
    under `options`; `open_model` loads a checkpoint for routing calibration, should a
    conversion with quant "auto" be needed.

    Raises CheckpointError, FTWFormatError, UnsupportedModelError (what the loaders raise),
    EngineError (an unknown or absent device, bad quant options, a combination that cannot
    run, a routing trace path that cannot be written), MemoryBudgetError (a budget below what
    the model needs to run).
    """
    t0 = time.perf_counter()
    path = Path(path).expanduser()
    if options.record_routing is not None:
        check_trace_path(options.record_routing)  # fail before loading anything
    if options.routing_profile is not None:
        check_profile(options.routing_profile)  # fail before loading anything
    device = check_device(options.device)
    dev = str(device)
    dtype = options.dtype
    expert_quant, dense_quant = options.expert_quant, options.dense_quant  # checked by EngineOptions
    if is_gguf_path(path):  # llama.cpp weights: converted once into the FTW cache, then an FTW file
        path = _converted_gguf(path, options)
    ftw_path: Path | None = None
    loaded_ftw = None
    hf = None
    if is_ftw_path(path):
        loaded_ftw = load_ftw(path, dtype=dtype, device=dev, expert_quant=expert_quant)
        ftw_path = path
        spec, model, hf_config = loaded_ftw.spec, loaded_ftw.model, loaded_ftw.hf_config
        tokenizer, tokenizer_error = loaded_ftw.tokenizer, loaded_ftw.tokenizer_error
    else:
        hf = load_hf_dense(path, dtype, dev)
        spec, model, hf_config = hf.spec, hf.model, hf.hf_config
        tokenizer, tokenizer_error = load_hf_tokenizer(path)

    # What resident experts take: an FTW file's compact projections count as kept (expert_quant).
    needed = loaded_ftw.experts.resident_bytes() if loaded_ftw is not None else expert_bytes(spec, dtype)
    choice = resolve_placement(options.placement, options.memory, needed, free_fast_bytes(device))
    logger.info("placement %s for %s: %s", choice.placement, path, choice.reason)
    memory = options.memory
    on_kv_resize = None
    if choice.placement == "resident" and options.routing_profile is not None:
        logger.warning("routing profile %s unused: the experts are resident", options.routing_profile)
    if choice.placement == "resident":
        if loaded_ftw is not None and device.type == "cuda":
            # Read every expert now and stack each layer: grouped GEMMs with no host sync, so the
            # decode step can be captured as a CUDA graph (the lazy provider dispatches expert by
            # expert, syncing each layer). On a CPU the file stays lazy (read on first use).
            experts: ExpertStore = InMemoryExpertProvider(loaded_ftw.experts.take_all(options.progress))
        elif loaded_ftw is not None:
            experts = loaded_ftw.experts
        else:
            assert hf is not None
            experts = InMemoryExpertProvider(load_hf_experts(hf, dtype, dev, int8=expert_quant == "int8"))
    else:
        if ftw_path is None:
            assert hf is not None
            ftw_path = _converted(hf, path, dtype, options, open_model)
        memory = tiered_budget(memory, device, free_fast_bytes(device), free_host_bytes())
        provider = _tiered_provider(ftw_path, memory, model, dtype, dev, choice, options)
        experts, on_kv_resize = provider, provider.on_kv_resize
        try:
            if options.routing_profile is not None:
                # streamed, read whole before a recorder replaces the file (if the same one)
                provider.warm_start(
                    iter_steps(read_trace(options.routing_profile)), progress=options.progress
                )
            elif options.tiering.fill_at_load:
                provider.fill_fast(progress=options.progress)
        except BaseException:
            provider.close()  # its threads and files
            raise
    quantize_dense(model, dense_quant)
    on_forward = None
    if options.record_routing is not None:
        try:
            recorder = RoutingRecorder(experts, options.record_routing)
        except BaseException:
            experts.close()  # the tiered provider's threads and files
            raise
        experts, on_forward = recorder, recorder.begin_step
    parts = LoadedModel(
        spec=spec,
        model=model,
        experts=experts,
        tokenizer=tokenizer,
        tokenizer_error=tokenizer_error,
        hf_config=hf_config,
        dtype=dtype,
        device=dev,
        memory=memory,
        source=path,
        placement=choice,
        on_kv_resize=on_kv_resize,
        on_forward=on_forward,
        expert_quant=expert_quant,
        dense_quant=dense_quant,
        generation_eos=read_generation_eos(path, loaded_ftw.ftw if loaded_ftw is not None else None),
        cuda_graphs=options.cuda_graphs,
    )
    logger.info(
        "loaded %s from %s in %.2fs (placement %s)",
        spec.model_type,
        path,
        time.perf_counter() - t0,
        choice.placement,
    )
    return parts


def check_profile(path: Path) -> None:
    """RoutingTraceError (one line) unless `path` is a routing trace whose first line reads: a
    missing or unreadable file, a malformed first line or no record at all is refused before the
    model loads; a later malformed line stops the warm start, naming its line."""
    records = read_trace(path)
    try:
        if next(records, None) is None:
            raise RoutingTraceError(f"routing profile {path} has no records")
    finally:
        records.close()


def _converted(
    hf: Any, folder: Path, dtype: torch.dtype, options: EngineOptions, open_model: OpenForCalibration
) -> Path:
    """The cached FTW of an HF folder that must be tiered (converted on first use)."""
    if options.quant is not None:
        quant, dense = options.quant, (dtype if dtype != torch.float16 else torch.float32)
    else:
        quant, dense = lossless_quant(folder, dtype, expert_source_dtype(hf))
    try:
        return cached_ftw(
            folder,
            quant=quant,
            dense_dtype=dense,
            cache_dir=options.cache_dir,
            progress=options.progress,
            open_model=open_model,
        )
    except ValueError as e:
        raise EngineError(f"cannot convert {folder} for tiered placement: {e}") from e
    except OSError as e:
        raise CheckpointError(f"cannot write the converted checkpoint of {folder}: {e}") from e


def _converted_gguf(path: Path, options: EngineOptions) -> Path:
    """The cached FTW conversion of a GGUF file (each expert weight in its own precision class,
    unless `options.quant` names one codec for all)."""
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    try:
        entry = cached_ftw(
            path,
            quant=options.quant or "source",
            dense_dtype=None,
            cache_dir=options.cache_dir,
            progress=options.progress,
        )
    except ValueError as e:
        raise EngineError(f"cannot convert {path}: {e}") from e
    except OSError as e:
        raise CheckpointError(f"cannot write the converted model of {path}: {e}") from e
    logger.info("%s is served from its FTW conversion %s", path, entry)
    return entry


def _tiered_provider(
    ftw_path: Path,
    memory: Any,
    model: MoETransformer,
    dtype: torch.dtype,
    device: str,
    choice: PlacementChoice,
    options: EngineOptions,
) -> TieredExpertProvider:
    spec = model.spec
    moe_layers = spec.moe_layers()
    top_k = {i: spec.layers[i].moe.top_k for i in moe_layers}  # type: ignore[union-attr]
    routers = {i: layer.mlp.router for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoEBlock)}
    return TieredExpertProvider(
        ftw_path,
        memory,
        top_k=top_k,
        dtype=dtype,
        device=device,
        routers=routers,
        attention=[layer.self_attn for layer in model.layers],
        placement=choice.placement,
        expert_quant=options.expert_quant,
        **options.tiering.provider_kwargs(),
    )
