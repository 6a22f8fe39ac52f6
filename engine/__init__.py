"""FreeToken's MoE inference engine.

from freetoken_agents.engine import Engine
engine = Engine.from_pretrained("path/to/hf-checkpoint")   # or an .ftw file, or a Hub id "org/name"
with engine.new_session() as s:
    logits = s.prefill([1, 2, 3])      # [T, V]
    logits = s.decode(4)               # [V]

Importing the package itself loads no submodule (PEP 562): each name imports its module on first
use, so the engine's command-line flags (`flags`, `choices`) and `freetoken --help` stay free of
torch and transformers (issue 65); `from freetoken_agents.engine import Engine` works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for type checkers and import-linter
    from .adapters import SUPPORTED_MODEL_TYPES
    from .anchors import ANCHOR_KINDS, Anchor, AnchorStore
    from .choices import EXPERT_QUANTS, PLACEMENTS, Placement
    from .engine import Engine
    from .errors import (
        AnchorError,
        AnchorFileError,
        AnchorFingerprintError,
        AnchorNotFoundError,
        AnchorSaveError,
        AnchorValidationError,
        ChatTemplateError,
        CheckpointError,
        ContextOverflowError,
        EngineError,
        FTWFormatError,
        InvalidTokenError,
        MemoryBudgetError,
        ModelNotFoundError,
        UnsupportedModelError,
    )
    from .loading.hub import HubId, is_hub_id, parse_hub_id, resolve_model
    from .loading.placement import check_device
    from .memory import MemoryBudget
    from .model.experts import ExpertStore, ExpertWeights, InMemoryExpertProvider
    from .options import EngineOptions, TieringOptions
    from .runtime.generate import GenerationResult, SamplingParams, TokenEvent
    from .runtime.session import Session
    from .spec import ModelSpec
    from .text.chat import DEFAULT_CHAT_TEMPLATE, render_chat
    from .text.detokenize import IncrementalDetokenizer
    from .text.stop_text import held_back_for_stops
    from .text.tokenize import encode_plain

_MODULES: dict[str, tuple[str, ...]] = {
    ".adapters": ("SUPPORTED_MODEL_TYPES",),
    ".anchors": ("ANCHOR_KINDS", "Anchor", "AnchorStore"),
    ".text.chat": ("DEFAULT_CHAT_TEMPLATE", "render_chat"),
    ".choices": ("EXPERT_QUANTS", "PLACEMENTS", "Placement"),
    ".text.detokenize": ("IncrementalDetokenizer",),
    ".engine": ("Engine",),
    ".errors": (
        "AnchorError",
        "AnchorFileError",
        "AnchorFingerprintError",
        "AnchorNotFoundError",
        "AnchorSaveError",
        "AnchorValidationError",
        "ChatTemplateError",
        "CheckpointError",
        "ContextOverflowError",
        "EngineError",
        "FTWFormatError",
        "InvalidTokenError",
        "MemoryBudgetError",
        "ModelNotFoundError",
        "UnsupportedModelError",
    ),
    ".model.experts": ("ExpertStore", "ExpertWeights", "InMemoryExpertProvider"),
    ".runtime.generate": ("GenerationResult", "SamplingParams", "TokenEvent"),
    ".loading.hub": ("HubId", "is_hub_id", "parse_hub_id", "resolve_model"),
    ".loading.placement": ("check_device",),
    ".memory": ("MemoryBudget",),
    ".options": ("EngineOptions", "TieringOptions"),
    ".runtime.session": ("Session",),
    ".spec": ("ModelSpec",),
    ".text.stop_text": ("held_back_for_stops",),
    ".text.tokenize": ("encode_plain",),
}
"""Submodule -> the public names it provides (the `TYPE_CHECKING` imports above, as data)."""
_EXPORTS: dict[str, str] = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "ANCHOR_KINDS",
    "DEFAULT_CHAT_TEMPLATE",
    "EXPERT_QUANTS",
    "SUPPORTED_MODEL_TYPES",
    "Anchor",
    "AnchorError",
    "AnchorFileError",
    "AnchorFingerprintError",
    "AnchorNotFoundError",
    "AnchorSaveError",
    "AnchorStore",
    "AnchorValidationError",
    "ChatTemplateError",
    "CheckpointError",
    "ContextOverflowError",
    "Engine",
    "EngineError",
    "EngineOptions",
    "ExpertStore",
    "ExpertWeights",
    "FTWFormatError",
    "GenerationResult",
    "HubId",
    "InMemoryExpertProvider",
    "IncrementalDetokenizer",
    "InvalidTokenError",
    "MemoryBudget",
    "MemoryBudgetError",
    "ModelNotFoundError",
    "PLACEMENTS",
    "Placement",
    "ModelSpec",
    "SamplingParams",
    "TieringOptions",
    "Session",
    "check_device",
    "TokenEvent",
    "UnsupportedModelError",
    "encode_plain",
    "held_back_for_stops",
    "is_hub_id",
    "parse_hub_id",
    "render_chat",
    "resolve_model",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then a plain module global)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
