"""FreeToken's MoE inference engine.

from freetoken_agents.engine import Engine
engine = Engine.from_pretrained("path/to/hf-checkpoint")   # or an .ftw file, or a Hub id "org/name"
with engine.new_session() as s:
    logits = s.prefill([1, 2, 3])      # [T, V]
    logits = s.decode(4)               # [V]
"""

from .adapters import SUPPORTED_MODEL_TYPES
from .anchors import ANCHOR_KINDS, Anchor, AnchorStore
from .chat import DEFAULT_CHAT_TEMPLATE, render_chat
from .detokenize import IncrementalDetokenizer
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
from .experts import ExpertStore, ExpertWeights, InMemoryExpertProvider
from .generate import GenerationResult, SamplingParams, TokenEvent
from .int8 import EXPERT_QUANTS
from .loading.hub import HubId, is_hub_id, parse_hub_id, resolve_model
from .loading.placement import check_device
from .memory import MemoryBudget
from .options import PLACEMENTS, EngineOptions, Placement, TieringOptions
from .session import Session
from .spec import ModelSpec
from .stop_text import held_back_for_stops
from .tokenize import encode_plain

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
