"""`AnchorHost`: what the anchor store (and saving and loading anchors) needs of the engine, and
nothing more: the KV pool the anchors pin, the lock every engine step holds, the model
fingerprint anchors are bound to, the context length and KV budget the default byte budget is
worked out from, and a snapshot of the expert store's cache state (what an anchor records besides
its KV). The Engine builds one after its KV pool and fingerprint, and the store over it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from ..model.kv import BlockPool
from .anchor import ExpertState


@dataclass(frozen=True)
class AnchorHost:
    """pool: the KV blocks anchors pin. lock: held by every store method (re-entrant: sessions
    hold it for their steps). model_fingerprint: `digest.model_fingerprint` of the engine.
    max_context: tokens per context. kv_bytes: the engine's KV budget (None: none set).
    expert_state: the expert store's cache state now (`anchor.snapshot_expert_state`)."""

    pool: BlockPool
    lock: AbstractContextManager[Any]
    model_fingerprint: str
    max_context: int
    kv_bytes: int | None
    expert_state: Callable[[], ExpertState]
