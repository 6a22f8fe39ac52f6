"""The engine's exception hierarchy.

Every error the engine raises on bad input derives from `EngineError`, so callers can catch one
type; each subclass names the situation and carries a message that says what to do about it.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error raised by `freetoken_agents.engine`."""


class CheckpointError(EngineError):
    """A checkpoint folder or file is missing, incomplete or inconsistent with its config."""


class ModelNotFoundError(CheckpointError):
    """A Hugging Face Hub id (``org/name[@revision][:QUANT]``) could not be resolved to local files
    (`hub.resolve_model`): the repo or revision does not exist or is private, the repo is gated
    and this account has no access, the files are not cached while offline (HF_HUB_OFFLINE=1) or
    the Hub cannot be reached, the repo holds no weights the engine loads, or a ``:QUANT`` matches
    no file or several. The message is one line naming the id and what to do (log in, unset
    HF_HUB_OFFLINE, check the id, pick a quant). `model_id`: the id as spelled.
    """

    def __init__(self, message: str, *, model_id: str) -> None:
        super().__init__(message)
        self.model_id = model_id


class UnsupportedModelError(EngineError):
    """The checkpoint's `model_type` has no architecture adapter."""


class ChatTemplateError(EngineError, ValueError):
    """The checkpoint's chat template refused the messages (its own `raise_exception`, or a
    Jinja error on their shape); the message is the template's, on one line."""


class ContextOverflowError(EngineError):
    """A session would grow past the model's maximum context length."""


class InvalidTokenError(EngineError):
    """A token id is outside the model's vocabulary (or the input is not a token sequence)."""


class MemoryBudgetError(EngineError):
    """A memory budget cannot hold what the engine needs to run, or a size cannot be read.

    `option`: the budget field at fault ("fast_bytes", "host_bytes", "kv_bytes"), when one is;
    `minimum_bytes`: the smallest value of it that would work, when known. Front ends (the CLI)
    use them to name their own flag.
    """

    def __init__(self, message: str, *, option: str | None = None, minimum_bytes: int | None = None) -> None:
        super().__init__(message)
        self.option = option
        self.minimum_bytes = minimum_bytes


class FTWFormatError(EngineError):
    """An FTW file is truncated, corrupted or not an FTW file; the message names file, block and offset."""


class AnchorError(EngineError):
    """Base class of the semantic-anchor errors (also raised for misuse, e.g. an unknown kind)."""


class AnchorNotFoundError(AnchorError):
    """No anchor with that id is in the engine's store (never created, evicted or discarded).

    The SDK rebuilds the state by prefill from the token ids it kept.
    """


class AnchorValidationError(AnchorError):
    """An anchor's KV data, token ids or identity do not match its signature or digests.

    Raised by `Session.rollback` (the session is left exactly as before the call) and by
    `AnchorStore.load` (nothing is loaded). The SDK rebuilds by prefill from the token ids.
    """


class AnchorFingerprintError(AnchorError):
    """An anchor belongs to another model (weights, tokenizer, KV layout or format version).

    Raised by `AnchorStore.load` (nothing is loaded) and by `Session.rollback` given a record made
    by another model's engine (the session is unchanged). Rebuild by prefill from the token ids.
    """


class AnchorFileError(AnchorError):
    """A saved anchor file is missing, truncated, corrupted or of an unknown format version."""


class AnchorSaveError(AnchorError):
    """Anchors could not be written to a folder (full disk, quota, I/O or permission error).

    The message names the folder and the cause. What the failed save wrote is removed and the
    previous save in that folder is still complete (see `anchors/savefolder.py`).
    """
