"""The Engine: load a checkpoint, own the weights, the KV pool and the expert provider."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from transformers import AutoConfig, PretrainedConfig

from .adapters import adapter_for
from .anchors.digest import model_fingerprint
from .anchors.store import AnchorStore
from .chat import render_chat
from .checkpoint import SafetensorsCheckpoint, read_config
from .errors import CheckpointError, EngineError
from .experts import ExpertKey, ExpertProvider, ExpertWeights, InMemoryExpertProvider
from .generate import GenerationResult, SamplingParams, TokenEvent, stream_tokens
from .int8 import check_quant_options, quantize_dense
from .kv import DEFAULT_BLOCK_SIZE, BlockPool, bytes_per_block
from .memory import MemoryBudget
from .session import Session
from .spec import ModelSpec
from .transformer import MoETransformer

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Engine:
    """A loaded MoE model. Create with `Engine.from_pretrained(path)`; run with sessions."""

    def __init__(
        self,
        spec: ModelSpec,
        model: MoETransformer,
        experts: ExpertProvider,
        *,
        tokenizer: Any | None = None,
        hf_config: PretrainedConfig | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        memory: MemoryBudget | None = None,
        source: Path | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        expert_quant: str = "auto",
        dense_quant: Sequence[str] = (),
    ) -> None:
        self.spec, self.model, self.experts = spec, model, experts
        # What `from_pretrained` was asked to hold in int8 (`int8.py`); recorded, not applied here.
        self.expert_quant, self.dense_quant = check_quant_options(expert_quant, dense_quant)
        self.hf_config = hf_config
        self.dtype, self.device = dtype, torch.device(device)
        self.memory = memory or MemoryBudget()
        self.source = source
        self._tokenizer = tokenizer
        model.attach_experts(experts)
        streams = model.kv_streams()
        max_blocks = None
        if self.memory.kv_bytes is not None:
            block_bytes = bytes_per_block(streams, block_size, dtype)
            max_blocks = max(1, self.memory.kv_bytes // block_bytes)
        self.kv_pool = BlockPool(
            streams, block_size=block_size, dtype=dtype, device=device, max_blocks=max_blocks
        )
        self.max_context = spec.max_position_embeddings
        self._model_fingerprint: str | None = None
        # Semantic anchors of this engine's sessions; a full KV pool first evicts cold anchors.
        self.anchors = AnchorStore(self)
        self.kv_pool.reclaim = self.anchors.reclaim

    # ---- loading ----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        memory: MemoryBudget | None = None,
        expert_quant: str = "auto",
        dense_quant: Sequence[str] = (),
    ) -> Engine:
        """Load a Hugging Face checkpoint folder (config.json + *.safetensors [+ tokenizer]) or an
        FTW file (`ftw.load.load_ftw`: experts are read and decoded on first use).

        Int8 weight-only compute (`int8.py`; fused int8 GEMV for decode, dequantize per block for
        prefill; nothing is held twice):
            expert_quant: ``"auto"`` (default) keeps expert projections stored in FTW's int8 codec
                in int8 and loads everything else in `dtype` (an HF checkpoint loads exactly as
                before); ``"int8"`` holds every expert projection in int8, quantizing float
                weights at load (per output row, the same bits as ``freetoken convert --quant
                int8``); ``"none"`` decodes every stored codec to `dtype`.
            dense_quant: parts of the dense model to hold in int8, a subset of
                ``("attention", "lm_head")``; default none.

        Raises CheckpointError (missing/garbled files or tensors), FTWFormatError (a corrupted,
        truncated or foreign FTW file), UnsupportedModelError (unknown model_type), EngineError
        (unsupported device, unknown expert_quant or dense_quant value).
        """
        expert_quant, dense_quant = check_quant_options(expert_quant, dense_quant)
        quant = {"expert_quant": expert_quant, "dense_quant": dense_quant}
        folder = Path(path)
        if device != "cpu" and not device.startswith("cuda"):
            raise EngineError(f"device must be 'cpu' or 'cuda[:N]', got '{device}'")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineError(f"device '{device}' requested but CUDA is not available")
        if folder.is_file() or (folder.suffix == ".ftw" and not folder.exists()):
            from .ftw.load import load_ftw

            ftw = load_ftw(folder, dtype=dtype, device=device, expert_quant=expert_quant)
            quantize_dense(ftw.model, dense_quant)
            return cls(
                ftw.spec,
                ftw.model,
                ftw.experts,
                tokenizer=ftw.tokenizer,
                hf_config=ftw.hf_config,
                dtype=dtype,
                device=device,
                memory=memory,
                source=folder,
                **quant,
            )
        t0 = time.perf_counter()
        raw = read_config(folder)
        adapter = adapter_for(raw["model_type"])
        try:
            hf_config = AutoConfig.from_pretrained(folder)
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise CheckpointError(f"cannot read the config in {folder}: {e}") from e
        spec = adapter.build_spec(hf_config)
        ckpt = SafetensorsCheckpoint(folder)
        model = MoETransformer(spec)
        load_dense_weights(model, lambda name: adapter.dense_tensor(ckpt, name), str(folder), dtype, device)
        experts: dict[ExpertKey, ExpertWeights] = {}
        for layer in spec.moe_layers():
            moe = spec.layers[layer].moe
            assert moe is not None
            for e, tensors in adapter.layer_experts(ckpt, layer, moe.num_experts):
                _check_expert_shapes(tensors, moe.intermediate_size, spec.hidden_size, layer, e, folder)
                if expert_quant == "int8":
                    experts[(layer, e)] = ExpertWeights.quantized(tensors, dtype, device)
                else:
                    experts[(layer, e)] = ExpertWeights.packed(tensors, dtype, device)
        quantize_dense(model, dense_quant)
        tokenizer = _load_tokenizer(folder)
        logger.info(
            "loaded %s (%d experts) from %s in %.2fs",
            spec.model_type,
            len(experts),
            folder,
            time.perf_counter() - t0,
        )
        return cls(
            spec,
            model,
            InMemoryExpertProvider(experts),
            tokenizer=tokenizer,
            hf_config=hf_config,
            dtype=dtype,
            device=device,
            memory=memory,
            source=folder,
            **quant,
        )

    def use_expert_provider(self, provider: ExpertProvider) -> None:
        """Route every MoE layer through `provider` (e.g. a tiered expert memory)."""
        self.experts = provider
        self.model.attach_experts(provider)

    # ---- tokenizer and chat -----------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The checkpoint's own tokenizer (transformers). EngineError if the checkpoint has none."""
        if self._tokenizer is None:
            raise EngineError(f"checkpoint {self.source} has no tokenizer files")
        return self._tokenizer

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    @property
    def model_fingerprint(self) -> str:
        """sha256 hex of weights, tokenizer, KV layout and anchor format (computed once; see
        `anchors.digest.model_fingerprint`). Anchors never cross engines with different ones.
        Non-default int8 options are mixed in: an int8 engine's KV data differs from fp32's."""
        if self._model_fingerprint is None:
            fingerprint = model_fingerprint(self)
            if (self.expert_quant, self.dense_quant) != ("auto", ()):
                dense = ",".join(self.dense_quant)
                tag = f"{fingerprint}|expert_quant={self.expert_quant}|dense_quant={dense}"
                fingerprint = hashlib.sha256(tag.encode()).hexdigest()
            self._model_fingerprint = fingerprint
        return self._model_fingerprint

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        tools: Sequence[dict] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of `messages` rendered with the checkpoint's chat template (or the default)."""
        rendered = render_chat(self.tokenizer, messages, tools, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(rendered, add_special_tokens=False)

    def default_stop_token_ids(self) -> tuple[int, ...]:
        eos = getattr(self.hf_config, "eos_token_id", None)
        if self._tokenizer is not None and self._tokenizer.eos_token_id is not None:
            eos = eos if eos is not None else self._tokenizer.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    # ---- sessions and generation ------------------------------------------------------------
    def new_session(self) -> Session:
        return Session(self)

    def stream(self, prompt_ids: Sequence[int], **params: Any) -> Iterator[TokenEvent]:
        """Generate from `prompt_ids` in a fresh session, yielding TokenEvents as they come.

        Keyword arguments are SamplingParams fields (max_new_tokens, temperature, top_k, top_p,
        seed, stop_token_ids, stop_strings). stop_token_ids defaults to the model's EOS.
        """
        sampling = self._params(params)
        with self.new_session() as session:
            yield from stream_tokens(session, prompt_ids, sampling, self._tokenizer)

    def generate(self, prompt_ids: Sequence[int], **params: Any) -> GenerationResult:
        """Generate and return all new tokens at once (see `stream` for the parameters)."""
        events = list(self.stream(prompt_ids, **params))
        return GenerationResult(
            token_ids=[e.token_id for e in events],
            text="".join(e.text for e in events),
            finish_reason=events[-1].finish_reason if events else "length",
            prompt_tokens=len(prompt_ids),
        )

    def _params(self, params: dict[str, Any]) -> SamplingParams:
        params = dict(params)
        params.setdefault("stop_token_ids", self.default_stop_token_ids())
        params["stop_token_ids"] = tuple(params["stop_token_ids"] or ())
        params["stop_strings"] = tuple(params.get("stop_strings") or ())
        try:
            return SamplingParams(**params)
        except ValidationError as e:  # names the offending fields
            raise EngineError(f"invalid generation parameters: {e}") from e

    def describe(self) -> dict:
        """A small JSON-able summary (architecture, sizes)."""
        return {
            "model_type": self.spec.model_type,
            "layers": self.spec.num_layers,
            "hidden_size": self.spec.hidden_size,
            "vocab_size": self.spec.vocab_size,
            "moe_layers": self.spec.moe_layers(),
            "dtype": str(self.dtype),
            "expert_quant": self.expert_quant,
            "dense_quant": list(self.dense_quant),
        }

    def stats(self) -> dict[str, Any]:
        """The expert provider's `stats()` when it has one (tiered memory: hits/misses, bytes
        moved, prefetch accuracy, bandwidth, decisions, phase times), else basic counters; both
        with the KV pool's `kv_blocks_in_use` / `kv_bytes_in_use`."""
        provider_stats = getattr(self.experts, "stats", None)
        if callable(provider_stats):
            out: dict[str, Any] = dict(provider_stats())
        else:
            loaded = getattr(self.experts, "loaded_keys", None) or getattr(self.experts, "keys", None)
            out = {
                "experts_in_ram": len(loaded()) if callable(loaded) else None,
                "expert_bytes_in_ram": getattr(self.experts, "nbytes", None),
            }
        pool = self.kv_pool
        out["kv_blocks_in_use"] = pool.blocks_in_use
        out["kv_bytes_in_use"] = pool.blocks_in_use * pool.bytes_per_block
        return out


def load_dense_weights(
    model: MoETransformer, get: Callable[[str], torch.Tensor], where: str, dtype: torch.dtype, device: str
) -> None:
    """Assign every dense parameter/buffer of `model` from `get(engine_name)` (shape-checked)."""
    keep_fp32 = model.fp32_parameter_names()
    state: dict[str, torch.Tensor] = {}
    for name, param in [*model.named_parameters(), *model.named_buffers()]:
        tensor = get(name)
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor for '{name}' in {where} has shape {list(tensor.shape)}, expected {list(param.shape)}"
            )
        state[name] = tensor.to(device=device, dtype=torch.float32 if name in keep_fp32 else dtype)
    model.load_state_dict(state, strict=True, assign=True)


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


def _load_tokenizer(folder: Path) -> Any | None:
    if not any((folder / f).exists() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the tokenizer in {folder}: {e}") from e
