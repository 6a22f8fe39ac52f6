"""Routing-frequency calibration for mixed-precision conversion (`convert --quant auto`).

`measure_routing` runs the real engine over a small calibration prompt set with a `RoutingCounter`
wrapped around its expert provider and counts, per MoE layer, how often the router selected each
expert. `hot_experts` turns those counts into the per-layer hot set that `AutoPolicy` stores in a
higher-precision codec; everything else gets the cold codec.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..ftw.codecs import CODECS
from ..model.experts import DelegatingStore, ExpertKey, ExpertStore
from ..spec import ModelSpec, MoESpec

logger = logging.getLogger(__name__)


class _Prefill(Protocol):
    def prefill(self, token_ids: list[int], *, last_only: bool = ...) -> torch.Tensor: ...


class CalibrationModel(Protocol):
    """What routing calibration runs (the `Engine` is one): its tokenizer, a fresh session per
    sequence, and a way to route its MoE layers through a counting wrapper of its expert store."""

    spec: ModelSpec
    max_context: int
    experts: ExpertStore

    @property
    def has_tokenizer(self) -> bool: ...
    @property
    def tokenizer(self) -> Any: ...
    def use_expert_provider(self, provider: ExpertStore) -> None: ...
    def new_session(self) -> AbstractContextManager[_Prefill]: ...
    def close(self) -> None: ...


OpenForCalibration = Callable[[Path, str], CalibrationModel]
"""(checkpoint folder, device) -> the model loaded there for calibration (`Engine.for_calibration`):
given to the converter, so loading never imports the engine it builds."""

CALIBRATION_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant. Answer the question as briefly as you can.",
    "What is the capital of France? The capital of France is Paris.",
    'def get_weather(city: str) -> dict:\n    """Return the weather."""\n    return {"city": city}\n',
    '{"name": "search", "arguments": {"query": "mixture of experts", "limit": 5}}',
    "The quick brown fox jumps over the lazy dog while the agent calls a tool.",
    "for i in range(10):\n    print(f'step {i}: value = {i * i}')\n",
    "Please book a table for two people at seven o'clock and confirm by email.",
    '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n</tool_call>',
)
"""Built-in calibration texts: chat, code, JSON tool calls and prose (short, so calibration is quick)."""


@dataclass(frozen=True)
class AutoPolicy:
    """How `--quant auto` splits experts into hot and cold.

    Attributes:
        hot_fraction: share of each layer's experts kept in `hot_codec`, the most frequently
            routed ones (rounded up: ``ceil(hot_fraction * num_experts)``); in [0, 1].
        hot_codec: codec of hot experts (one of `CODECS`).
        cold_codec: codec of the other experts.
        prompts: calibration texts, tokenized with the checkpoint's tokenizer.
        max_tokens: tokens per calibration prompt (longer prompts are cut).
        random_prompts: number of random token sequences used instead when the checkpoint has no
            tokenizer (each `max_tokens` long, drawn with `seed`).
        seed: seed of those random sequences.
    """

    hot_fraction: float = 0.25
    hot_codec: str = "bf16"
    cold_codec: str = "mxfp4"
    prompts: tuple[str, ...] = CALIBRATION_PROMPTS
    max_tokens: int = 64
    random_prompts: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.hot_fraction <= 1.0:
            raise ValueError(f"hot_fraction must be in [0, 1], got {self.hot_fraction}")
        for what in ("hot_codec", "cold_codec"):
            if getattr(self, what) not in CODECS:
                raise ValueError(f"{what} {getattr(self, what)!r} is not a codec; known: {', '.join(CODECS)}")
        if self.max_tokens < 1 or self.random_prompts < 1:
            raise ValueError("max_tokens and random_prompts must be >= 1")
        object.__setattr__(self, "prompts", tuple(self.prompts))

    def to_dict(self) -> dict:
        """JSON-serialisable form (stored in the FTW manifest's metadata)."""
        d = asdict(self)
        d["prompts"] = list(self.prompts)
        return d


class RoutingCounter(DelegatingStore):
    """An `ExpertStore` wrapper that counts the router's selections and delegates everything.

    Attributes:
        inner: the wrapped provider.
        counts: ``{layer: int64 tensor [E]}``, selections per expert (a token choosing an expert
            counts once).
        selected: every ``(layer, expert)`` selected at least once.
    """

    def __init__(self, inner: ExpertStore) -> None:
        super().__init__(inner)
        self.counts: dict[int, torch.Tensor] = {}
        self.selected: set[ExpertKey] = set()

    def run(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, spec: MoESpec
    ) -> torch.Tensor:
        """hidden [T, H], expert_ids [T, A] (int64), weights [T, A] -> [T, H], counting expert_ids."""
        flat = expert_ids.reshape(-1).cpu()
        counts = self.counts.setdefault(layer, torch.zeros(spec.num_experts, dtype=torch.int64))
        counts += torch.bincount(flat, minlength=spec.num_experts)
        self.selected.update((layer, int(e)) for e in flat.unique().tolist())
        return self.inner.run(layer, hidden, expert_ids, weights, spec)


def calibration_token_ids(engine: CalibrationModel, policy: AutoPolicy) -> list[list[int]]:
    """The calibration sequences for `engine`: the policy's prompts tokenized with the engine's
    tokenizer, or random token sequences when it has none. Ids outside the model vocab are dropped."""
    vocab = engine.spec.vocab_size
    limit = min(policy.max_tokens, engine.max_context)
    seqs: list[list[int]] = []
    if engine.has_tokenizer and policy.prompts:
        tok = engine.tokenizer
        for text in policy.prompts:
            ids = [i for i in tok.encode(text, add_special_tokens=False) if 0 <= i < vocab][:limit]
            if ids:
                seqs.append(ids)
    if not seqs:
        gen = torch.Generator().manual_seed(policy.seed)
        seqs = [
            torch.randint(0, vocab, (limit,), generator=gen).tolist() for _ in range(policy.random_prompts)
        ]
    return seqs


def measure_routing(engine: CalibrationModel, policy: AutoPolicy) -> tuple[dict[int, list[int]], int]:
    """Run `engine` over the calibration set; return ``({layer: selections per expert}, tokens)``.

    Each sequence is prefilled in a fresh session. The engine's expert provider is restored
    afterwards, even on error.
    """
    original = engine.experts
    counter = RoutingCounter(original)
    engine.use_expert_provider(counter)
    tokens = 0
    try:
        for ids in calibration_token_ids(engine, policy):
            with engine.new_session() as session:
                session.prefill(ids, last_only=True)
            tokens += len(ids)
    finally:
        engine.use_expert_provider(original)
    counts = {layer: c.tolist() for layer, c in sorted(counter.counts.items())}
    logger.info("calibration: %d tokens over %d MoE layers", tokens, len(counts))
    return counts, tokens


def hot_experts(counts: dict[int, list[int]], hot_fraction: float) -> dict[int, list[int]]:
    """Per layer, the ``ceil(hot_fraction * E)`` most selected experts (ties: lower id first), sorted."""
    out: dict[int, list[int]] = {}
    for layer, c in counts.items():
        n_hot = min(len(c), math.ceil(hot_fraction * len(c) - 1e-9))
        order = sorted(range(len(c)), key=lambda e: (-c[e], e))
        out[layer] = sorted(order[:n_hot])
    return out
