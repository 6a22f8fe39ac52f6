"""The engine's exception hierarchy.

Every error the engine raises on bad input derives from `EngineError`, so callers can catch one
type; each subclass names the situation and carries a message that says what to do about it.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error raised by `freetoken_agents.engine`."""


class CheckpointError(EngineError):
    """A checkpoint folder or file is missing, incomplete or inconsistent with its config."""


class UnsupportedModelError(EngineError):
    """The checkpoint's `model_type` has no architecture adapter."""


class ContextOverflowError(EngineError):
    """A session would grow past the model's maximum context length."""


class InvalidTokenError(EngineError):
    """A token id is outside the model's vocabulary (or the input is not a token sequence)."""


class MemoryBudgetError(EngineError):
    """A memory budget cannot hold what the engine needs to run."""


class FTWFormatError(EngineError):
    """An FTW file is truncated, corrupted or not an FTW file; the message names file, block and offset."""
