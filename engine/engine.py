"""The Engine: owns the weights, the KV pool, the expert provider and the anchors of a loaded model;
runs sessions (`Session`) and generation. Built by `Engine.from_pretrained` from the parts
`loading.assemble` loads."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from transformers import PretrainedConfig

from .anchors.anchor import snapshot_expert_state
from .anchors.digest import model_fingerprint
from .anchors.host import AnchorHost
from .anchors.store import AnchorStore
from .errors import ContextOverflowError, EngineError
from .kernels.int8 import DenseQuantPart, ExpertQuant
from .loading.assemble import assemble
from .loading.hub import resolve_model
from .loading.placement import PlacementChoice, expert_bytes
from .memory import MemoryBudget
from .model.experts import ExpertStore
from .model.kv import DEFAULT_BLOCK_SIZE, BlockPool, bytes_per_block
from .model.transformer import MoETransformer
from .options import EngineOptions, Placement, TieringOptions
from .runtime.decode_runner import DecodeRunner
from .runtime.generate import GenerationResult, SamplingParams, TokenEvent, stream_tokens
from .runtime.session import Session
from .spec import ModelSpec
from .text.chat import render_chat_spans
from .text.stop_tokens import stop_token_ids
from .text.tokenize import encode as encode_text
from .text.tokenize import encode_segments, longest_token_chars

logger = logging.getLogger(__name__)

NORMALIZER_FOLD = 4
"""The most characters a tokenizer's normalizer folds into one (NFC composes up to three Hangul jamo
into one syllable), with room to spare: a rendered prompt longer than max_context x the longest
token x this cannot fit, and is refused before it is tokenized."""


class Engine:
    """A loaded MoE model. Create with `Engine.from_pretrained(path, ...)`; run with sessions.

    `Engine.from_pretrained` loads the parts (`loading.assemble`: the composition root); the
    constructor wires what depends on them, in order: the KV pool (with the expert store's
    `on_kv_resize`, when its fast memory is shared with the KV cache, and the anchor store's
    `reclaim`), the model fingerprint, taken here, at load, then the anchor store over an
    `AnchorHost`: what anchors need of the engine, never the engine itself.
    """

    def __init__(
        self,
        spec: ModelSpec,
        model: MoETransformer,
        experts: ExpertStore,
        *,
        tokenizer: Any | None = None,
        tokenizer_error: str | None = None,
        hf_config: PretrainedConfig | None = None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        memory: MemoryBudget | None = None,
        source: Path | None = None,
        placement: PlacementChoice | None = None,
        on_kv_resize: Callable[[int], None] | None = None,
        on_forward: Callable[[str, int, int], None] | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        expert_quant: ExpertQuant = "auto",
        dense_quant: Sequence[DenseQuantPart] = (),
        generation_eos: int | Sequence[int] | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        self.spec, self.model, self.experts = spec, model, experts
        # Runs the sessions' forward passes: eager, or decode by CUDA graph (`cuda_graphs`; switch
        # with `decode_runner.cuda_graphs = ...`).
        self.decode_runner = DecodeRunner(model, cuda_graphs=cuda_graphs)
        self._own_experts = experts  # closed by `close` even while a wrapper is in use
        # Told of every forward pass before it runs (`SessionHost.on_forward`: the routing recorder).
        self.on_forward = on_forward
        # What `from_pretrained` was asked to hold in int8 (`int8.py`); recorded, not applied here
        # (checked by `EngineOptions`; dense parts sorted so the fingerprint tag is canonical).
        self.expert_quant = expert_quant
        self.dense_quant: tuple[DenseQuantPart, ...] = tuple(sorted(set(dense_quant)))
        self.hf_config = hf_config
        self.dtype, self.device = dtype, torch.device(device)
        self.memory = memory or MemoryBudget()
        self.source = source
        self.placement = placement or PlacementChoice("resident", "built directly")
        self._tokenizer = tokenizer
        self._tokenizer_error = tokenizer_error
        # every eos id the checkpoint declares (`stop_tokens`)
        self._stop_ids = stop_token_ids(hf_config, tokenizer, generation_eos)
        model.attach_experts(experts)
        streams = model.kv_streams()
        max_blocks = None
        if self.memory.kv_bytes is not None:
            block_bytes = bytes_per_block(streams, block_size, dtype)
            max_blocks = max(1, self.memory.kv_bytes // block_bytes)
        self.kv_pool = BlockPool(
            streams,
            block_size=block_size,
            dtype=dtype,
            device=device,
            max_blocks=max_blocks,
            reclaim=self._reclaim_anchor_blocks,  # a full KV pool first evicts cold anchors
            on_resize=on_kv_resize,
        )
        self.max_context = spec.max_position_embeddings
        # Held by every session step (`Session`): many callers, one engine state.
        self.lock = threading.RLock()
        self._model_fingerprint = self._fingerprint()
        # Semantic anchors of this engine's sessions, over what they need of it (never the Engine).
        host = AnchorHost(
            pool=self.kv_pool,
            lock=self.lock,
            model_fingerprint=self._model_fingerprint,
            max_context=self.max_context,
            kv_bytes=self.memory.kv_bytes,
            expert_state=lambda: snapshot_expert_state(self.experts),
        )
        self.anchors = AnchorStore(host)

    def _reclaim_anchor_blocks(self) -> bool:
        """The KV pool's hook when it runs full: evict the coldest unpinned anchor."""
        return self.anchors.reclaim()

    # ---- loading ----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype | str = torch.float32,
        memory: MemoryBudget | dict[str, Any] | None = None,
        placement: Placement = "auto",
        expert_quant: ExpertQuant = "auto",
        dense_quant: Sequence[DenseQuantPart] = (),
        quant: str | None = None,
        cache_dir: str | Path | None = None,
        progress: bool = True,
        tiering: TieringOptions | None = None,
        record_routing: str | Path | None = None,
        routing_profile: str | Path | None = None,
        cuda_graphs: bool = True,
    ) -> Engine:
        """Load a Hugging Face checkpoint folder (config.json + *.safetensors [+ tokenizer]), an
        FTW file, or a Hugging Face Hub id ``org/name[@revision][:QUANT]`` (fetched into the
        huggingface_hub cache, `hub.resolve_model`; an existing local path of the same spelling
        wins), with its experts where `placement` and `memory` say (`options.EngineOptions`
        documents every option; `loading/assemble.py` is where its parts are loaded).

            memory: byte budgets: fast_bytes (tier 1 + KV cache), host_bytes (tier 2), kv_bytes
                (the KV cache alone). A fast or host budget makes placement "auto" tier the
                experts; so does a model whose experts do not fit free memory.
            placement: "auto" | "resident" | "qstar" | "stream"; what was chosen, and why, is
                logged and in `stats()["placement"]`.
            quant: FTW codec of the cached conversion of an HF folder that must be tiered
                (default: lossless); cache_dir: where it is cached (default $FREETOKEN_CACHE,
                else the user cache dir).
            expert_quant / dense_quant: int8 weight-only compute (`int8.py`): "auto" keeps expert
                projections stored in FTW's int8 codec in int8 (tiered too: tier 1 on the CPU
                and HOST compute); "int8" quantizes every expert projection at load (not with
                tiers on a GPU); "compact" also keeps MXFP4 projections 4-bit (`mxfp4.py`; tier
                1 on a GPU too); "none" decodes every codec to `dtype`. dense_quant: a
                subset of ("attention", "lm_head").
            record_routing: a file (created or replaced; its folder must exist) receiving the
                routing of every token the engine runs, one JSON line per (token, MoE layer)
                (`routing_trace` documents the format; written in whole lines, complete once the
                engine is closed or the program exits).
            routing_profile: a routing trace of this model (as `record_routing` writes) that
                tiered experts start from instead of a cold fast tier: q*'s routing frequencies
                are seeded from it and tier 1 is filled with its most used experts while loading
                (`TieredExpertProvider.warm_start`); no effect on resident experts.
            cuda_graphs: decode steps replay a captured CUDA graph where the model allows it (on
                CUDA with Triton, no int8 dense layers, experts resident or tier 1 a slot pool;
                `decode_runner`); False: eager.

        Raises CheckpointError (missing/garbled files or tensors; its ModelNotFoundError: a Hub id
        that cannot be fetched: missing, gated, offline with nothing cached), FTWFormatError (a corrupted,
        truncated or foreign FTW file), UnsupportedModelError (unknown model_type), EngineError
        (bad options: an unknown or absent device, an unknown quant or placement, a
        record_routing path that cannot be written), RoutingTraceError (a routing_profile that
        cannot be read or names layers or experts the model lacks),
        MemoryBudgetError (a budget below what one layer needs, naming the smallest that works).
        """
        options = EngineOptions.parse(
            device=device,
            dtype=dtype,
            memory=memory,
            placement=placement,
            expert_quant=expert_quant,
            dense_quant=dense_quant,
            quant=quant,
            cache_dir=cache_dir,
            progress=progress,
            tiering=tiering or TieringOptions(),
            record_routing=record_routing,
            routing_profile=routing_profile,
            cuda_graphs=cuda_graphs,
        )
        return cls.from_options(path, options)

    @classmethod
    def from_options(cls, path: str | Path, options: EngineOptions) -> Engine:
        """`from_pretrained` with the options already validated (what every front end passes).
        A Hub id is resolved here, once, to local files (`hub.resolve_model`)."""
        parts = assemble(resolve_model(path, progress=options.progress), options, cls.for_calibration)
        return cls(**parts.as_kwargs())

    @classmethod
    def for_calibration(cls, folder: Path, device: str) -> Engine:
        """The engine routing calibration runs (`convert --quant auto`): fp32 on a CPU, bf16 on a
        GPU, with the "auto" placement."""
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        return cls.from_pretrained(folder, device=device, dtype=dtype)

    def use_expert_provider(self, provider: ExpertStore) -> None:
        """Route every MoE layer through `provider`, a wrapper of the current one (routing
        counters for calibration, recorders in benchmarks); the KV pool keeps its wiring.
        A routing trace (`record_routing`) keeps recording through a wrapper that delegates `run`
        to the store it wraps (`DelegatingStore` does); passes of a provider that computes the
        experts itself never reach the recorder and are not in the trace. `close` closes the
        store the engine was built with (and so the trace) whatever provider is in use."""
        self.experts = provider
        self.model.attach_experts(provider)

    def close(self) -> None:
        """Stop the expert provider's threads and close its files (tiered placements; a routing
        trace is written out). The engine must not be used afterwards. Idempotent."""
        try:
            self.experts.close()
        finally:
            if self._own_experts is not self.experts:  # a wrapper does not own what it wraps
                self._own_experts.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- tokenizer and chat -----------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The checkpoint's own tokenizer (transformers). EngineError if the checkpoint has none."""
        if self._tokenizer is None:
            why = self._tokenizer_error or f"checkpoint {self.source} has no tokenizer"
            raise EngineError(f"{why}: this engine runs on token ids only")
        return self._tokenizer

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    @property
    def model_fingerprint(self) -> str:
        """sha256 hex of weights, tokenizer, KV layout and anchor format, taken when the engine
        was built (`anchors.digest.model_fingerprint`): replacing the file afterwards does not
        change it. Anchors never cross engines with different ones."""
        return self._model_fingerprint

    def _fingerprint(self) -> str:
        """Non-default int8 options are mixed in: an int8 engine's KV data differs from fp32's."""
        fingerprint = model_fingerprint(
            pool=self.kv_pool,
            source=self.source,
            spec=self.spec,
            model=self.model,
            experts=self.experts,
            tokenizer=self._tokenizer,
        )
        if (self.expert_quant, self.dense_quant) != ("auto", ()):
            dense = ",".join(self.dense_quant)
            tag = f"{fingerprint}|expert_quant={self.expert_quant}|dense_quant={dense}"
            fingerprint = hashlib.sha256(tag.encode()).hexdigest()
        return fingerprint

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        tools: Sequence[dict] | None = None,
        *,
        add_generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of `messages` rendered with the checkpoint's chat template (or the default);
        `variables`: more template variables (chat-template kwargs, e.g. `enable_thinking`).

        Only the template's own markup and the trusted roles' contents (system prompt, the
        assistant's past turns: `chat.TRUSTED_ROLES`) can yield control tokens; a special-token
        string in a user or tool message is tokenized as plain text, so a tool result cannot forge a
        turn. Text without such strings gets exactly the tokenizer's own ids. ContextOverflowError,
        before tokenizing, for a rendering too long to fit in the context however it tokenizes."""
        rendered, untrusted = render_chat_spans(
            self.tokenizer, messages, tools, add_generation_prompt=add_generation_prompt, variables=variables
        )
        bound = self.max_context * longest_token_chars(self.tokenizer) * NORMALIZER_FOLD
        if len(rendered) > bound:  # certainly over the context: not worth tokenizing
            raise ContextOverflowError(
                f"the rendered prompt has {len(rendered)} characters, more than the model's context of "
                f"{self.max_context} tokens can hold (at most {bound}); shorten the messages"
            )
        return encode_segments(self.tokenizer, rendered, untrusted)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added), in time linear in its length: long
        whitespace-free runs are tokenized in slices (`tokenize.encode`)."""
        return encode_text(self.tokenizer, text)

    def default_stop_token_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id the checkpoint declares (`stop_tokens`): config.json's,
        generation_config.json's, the tokenizer's."""
        return self._stop_ids

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
            "expert_bytes": expert_bytes(self.spec, self.dtype),
            "placement": self.placement.placement,
        }

    def stats(self) -> dict[str, Any]:
        """`placement` ("resident", "qstar" or "stream") and `placement_reason`; the expert
        provider's `stats()` when it has one (tiered memory: `tiers` with fast/host/storage
        counters, bytes moved, prefetch accuracy, bandwidth, decisions, phase times), else basic
        counters; the KV pool's `kv_blocks_in_use` / `kv_bytes_in_use`."""
        out = dict(self.experts.stats())
        out["placement"] = self.placement.placement
        out["placement_reason"] = self.placement.reason
        pool = self.kv_pool
        out["kv_blocks_in_use"] = pool.blocks_in_use
        out["kv_bytes_in_use"] = pool.blocks_in_use * pool.bytes_per_block
        return out
