"""A session: one token sequence, its paged KV cache, and prefill / decode / truncate / fork.

A session may hold *pending* tokens: tokens that are part of the sequence (e.g. the last token
generate() sampled) but not yet run through the model. The next prefill or decode runs them
first; truncate and fork treat them like any other token.

Anchors (`anchor()` / `rollback()`, see `engine.anchors`) pin a state of the session and return
to it by pointer work: the session takes a fork of the anchor's block table and its token ids.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import torch

from ..anchors.anchor import Anchor, Validation, check_fingerprint, restore_expert_state, verify_anchor
from ..anchors.store import AnchorStore
from ..errors import ContextOverflowError, EngineError, InvalidTokenError
from ..model.experts import ExpertStore
from ..model.kv import BlockPool, BlockTable
from ..model.layers import StepContext, rope_cos_sin
from ..spec import ModelSpec


class ForwardPass(Protocol):
    """A forward pass of the model: tokens [T] -> logits [T, V] (or [1, V] with last_only),
    writing the tokens' KV through `ctx` (`decode_runner.DecodeRunner` is one)."""

    def __call__(self, tokens: torch.Tensor, ctx: StepContext, *, last_only: bool = ...) -> torch.Tensor: ...


class SessionHost(Protocol):
    """What a session runs on (the `Engine` is one): the runner of the model's forward passes
    (`decode_runner`: eager, or a decode step by CUDA graph) and its expert store, the KV pool
    and anchors it shares with the other sessions, and the lock every step holds. Declared here
    so this module never imports the engine that creates sessions.

    `on_forward(session_id, start, count)`, when set, is told of every forward pass before it
    runs (under the lock): `count` tokens of the session `session_id` from position `start`
    (the routing recorder, `routing_record.RoutingRecorder.begin_step`)."""

    spec: ModelSpec
    decode_runner: ForwardPass
    experts: ExpertStore
    kv_pool: BlockPool
    anchors: AnchorStore
    lock: AbstractContextManager[Any]
    max_context: int
    device: torch.device
    dtype: torch.dtype
    on_forward: Callable[[str, int, int], None] | None

    @property
    def model_fingerprint(self) -> str: ...


T = TypeVar("T")


def _engine_step(method: Callable[..., T]) -> Callable[..., T]:
    """Run a Session method under its engine's lock (see `Session`)."""

    @functools.wraps(method)
    def locked(self: Session, *args: Any, **kwargs: Any) -> T:
        with self.engine.lock:
            return method(self, *args, **kwargs)

    return locked


class Session:
    """Created by `Engine.new_session()`; one sequence per session.

    Many sessions of one engine may run in different threads: every step that touches the
    engine's shared state (the forward pass, which writes the KV pool and moves experts; truncate,
    fork, anchor, rollback, close) holds `engine.lock` for that step only, so steps of different
    sessions interleave, each session sees only its own KV, and a session's results are exactly
    what it would get alone. One session must not be used by two threads at once.
    """

    def __init__(
        self, engine: SessionHost, table: BlockTable | None = None, token_ids: Sequence[int] = ()
    ) -> None:
        self.engine = engine
        self.table = table if table is not None else BlockTable(engine.kv_pool)
        self._tokens: list[int] = list(token_ids)
        self._pending: list[int] = []
        self._closed = False
        self.id = uuid.uuid4().hex  # names the session in anchor records
        self._lineage: list[tuple[int, str]] = []  # (position, id) of anchors on this branch

    # ---- state ----------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Number of tokens in the sequence (including pending ones)."""
        return len(self._tokens) + len(self._pending)

    @property
    def token_ids(self) -> list[int]:
        """A copy of the sequence's token ids."""
        return self._tokens + self._pending

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV is in the cache."""
        return self.table.length

    # ---- model steps ------------------------------------------------------------------------
    @_engine_step
    def prefill(self, token_ids: Sequence[int] | torch.Tensor, *, last_only: bool = False) -> torch.Tensor:
        """Append `token_ids` and run them. Returns logits [T, V] (T = len(token_ids)), or [1, V]
        for the last token only with `last_only`."""
        ids = self._validate(token_ids)
        run = self._pending + ids
        logits = self._forward(run, last_only=last_only)
        self._tokens.extend(run)
        self._pending = []
        return logits if last_only else logits[len(run) - len(ids) :]

    def decode(self, token_id: int) -> torch.Tensor:
        """Append one token and run it; returns logits [V] for the next position."""
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise InvalidTokenError(f"decode() takes one int token id, got {type(token_id).__name__}")
        return self.prefill([token_id], last_only=True)[0]

    def append_unprocessed(self, token_id: int) -> None:
        """Add a token to the sequence without running it yet (it runs with the next step)."""
        self._validate([token_id])
        self._pending.append(token_id)

    @_engine_step
    def truncate(self, position: int) -> None:
        """Keep the first `position` tokens. O(number of KV blocks)."""
        self._check_open()
        if not 0 <= position <= self.position:
            raise EngineError(f"cannot truncate a session of {self.position} tokens to {position}")
        self._pending = self.token_ids[len(self._tokens) :][: max(0, position - len(self._tokens))]
        self._tokens = self._tokens[:position]
        if self.table.length > position:
            self.table.truncate(position)
            self.engine.anchors.enforce_budget()  # released blocks may now be anchor-only
        while self._lineage and self._lineage[-1][0] > position:
            self._lineage.pop()

    @_engine_step
    def fork(self) -> Session:
        """An independent session sharing this one's KV blocks (copy-on-write). O(blocks)."""
        self._check_open()
        twin = Session(self.engine, self.table.fork(), self._tokens)
        twin._pending = list(self._pending)
        twin._lineage = list(self._lineage)
        return twin

    # ---- anchors ------------------------------------------------------------------------------
    @property
    def parent_anchor_id(self) -> str | None:
        """The nearest anchor at or before the current position on this branch, if any."""
        return self._lineage[-1][1] if self._lineage else None

    @_engine_step
    def anchor(self, kind: str, label: str | None = None) -> Anchor:
        """Pin the current state in `engine.anchors` and return its (immutable) record.

        `kind`: system_prompt, tool_call, tool_result, code_block or manual (AnchorError
        otherwise). Cost: O(block_size) KV bytes hashed plus O(blocks) bookkeeping, never a pass
        over the cache. Anchoring an identical state again returns the stored record.
        """
        self._check_open()
        self.table.seal_full_blocks()
        parent = self._lineage[-1][1] if self._lineage else None
        anchor = self.engine.anchors.create(
            self.table, self.token_ids, kind=kind, label=label, parent_id=parent, session_id=self.id
        )
        if not self._lineage or self._lineage[-1][1] != anchor.id:
            self._lineage.append((anchor.position, anchor.id))
        return anchor

    @_engine_step
    def rollback(self, anchor: Anchor | str, validate: Validation | None = None) -> Anchor:
        """Return to `anchor` (a record or its id): its token ids and KV, by pointer work.

        Any anchor of this engine works, on this branch or another (or another session's).
        `validate` (`anchors.anchor.verify_anchor`): None or "blocks" (default) rehashes every
        KV block the anchor covers (catches any single changed value); "signature" (opt-in,
        cheaper) checks the token-prefix hash and the first/last 512 KV bytes; "full" also
        recomputes the anchor id; AnchorError for any other value. The check runs on a scratch
        view before the swap:
        AnchorNotFoundError (unknown or evicted id), AnchorFingerprintError (a record made by
        another model's engine) or AnchorValidationError leave the session exactly as it was.
        The partial last block is copied by the first write after it.
        """
        self._check_open()
        if isinstance(anchor, Anchor):
            check_fingerprint(anchor, self.engine.model_fingerprint)  # a record from another engine
        found = self.engine.anchors.get(anchor if isinstance(anchor, str) else anchor.id)
        scratch = found.table.fork()
        try:
            verify_anchor(found, scratch, self.engine.model_fingerprint, validate)
        except BaseException:
            scratch.release()
            raise
        old, self.table = self.table, scratch
        old.release()
        self.engine.anchors.enforce_budget()
        self._tokens = list(found.token_ids[: found.kv_length])
        self._pending = list(found.token_ids[found.kv_length :])
        self._lineage = self.engine.anchors.lineage(found)
        restore_expert_state(self.engine.experts, found.expert_state)
        return found

    @_engine_step
    def close(self) -> None:
        """Release the session's KV blocks. Idempotent."""
        if not self._closed:
            self.table.release()
            self._closed = True
            self.engine.anchors.enforce_budget()  # blocks only anchors hold now count

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("this session is closed")

    def _validate(self, token_ids: Sequence[int] | torch.Tensor) -> list[int]:
        self._check_open()
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dim() != 1 or token_ids.is_floating_point():
                raise InvalidTokenError(
                    f"token ids must be a 1-D integer tensor, got shape {list(token_ids.shape)}"
                )
            ids = token_ids.tolist()
        else:
            ids = list(token_ids)
        if not ids:
            raise InvalidTokenError("no token ids given")
        vocab = self.engine.spec.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidTokenError(f"token at index {i} is {t!r}, not an int")
            if not 0 <= t < vocab:
                raise InvalidTokenError(f"token id {t} at index {i} is outside the vocabulary [0, {vocab})")
        limit = self.engine.max_context
        if self.position + len(ids) > limit:
            raise ContextOverflowError(
                f"{self.position} tokens in the session + {len(ids)} new exceed "
                f"the model's context of {limit}"
            )
        return ids

    def _forward(self, ids: list[int], *, last_only: bool) -> torch.Tensor:
        engine = self.engine
        start = self.table.length
        positions = torch.arange(start, start + len(ids), device=engine.device)
        cos, sin = rope_cos_sin(engine.spec.rope, positions, engine.dtype)
        if engine.on_forward is not None:
            engine.on_forward(self.id, start, len(ids))
        with torch.inference_mode():
            new_slots = self.table.reserve(len(ids))
            ctx = StepContext(self.table, new_slots, positions, cos, sin)
            try:
                tokens = torch.tensor(ids, dtype=torch.long, device=engine.device)
                logits = engine.decode_runner(tokens, ctx, last_only=last_only)
            except BaseException:
                self.table.truncate(start)  # never leave half-written KV behind
                raise
            self.table.seal_full_blocks()  # digest each block once, when it fills (anchors)
        return logits
