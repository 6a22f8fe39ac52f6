"""Incremental detokenisation for the SDK: the engine's `IncrementalDetokenizer`, re-exported.

The implementation lives in `freetoken_agents.engine.text.detokenize` (the engine's stream uses it too).
"""

from __future__ import annotations

from .engine import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer"]
