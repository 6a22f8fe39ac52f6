"""The adapter's backend: FreeTokenModel as ChatFreeToken drives it.

One backend (one engine session) per loaded engine, shared by every ChatFreeToken with the same
options: its context is the latest prompt and reply, and the integrations' shared
`prefix_cache.prepare_context` reuses it (or an anchored earlier prompt) for the next call.
Everything the adapter needs is FreeTokenModel's public API: `generate` for turns (forced tool
calls included) and `decode_json` for structured output, both on the SDK's one constrained
decoder; `pin` / `restore` for the prefix cache (restores honour `validate`, like every rollback).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from freetoken_agents.model import FreeTokenModel

if TYPE_CHECKING:
    from freetoken_agents.engine import Engine


class LangChainBackend(FreeTokenModel):
    """FreeTokenModel with the adapter's defaults (fewer anchors: its prefix cache pins prompts
    itself). `validate`: how restores and rollbacks check anchors (None: the engine's default)."""

    def __init__(
        self, engine: Engine, *, family: str | None = None, validate: str | None = None, max_anchors: int = 32
    ) -> None:
        super().__init__(engine, family=family, max_anchors=max_anchors, validate=validate)
