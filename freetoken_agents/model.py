"""The backend protocol the Agent talks to, and FreeTokenModel, its implementation over the engine.

The protocol is narrow on purpose (render, sync/prefill, generate, anchor, rollback, usage) so an
OpenAI-compatible server with prefix caching can follow: there rollback means "resend the kept
prefix" and the server's prefix cache absorbs it.

FreeTokenModel is also the typed seam between the SDK and the engine: the turn decoder
(`_decode.py`), the constrained decoder and the LangChain adapter drive the engine only through
its public methods (prefill, decode, next_logits, truncate, append_pending, restore, pin,
decode_json), never through its session's or its own private state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, Field

from freetoken_agents.engine import SamplingParams
from freetoken_agents.engine.generate import Sampler

from .anchors import AnchorBook, AnchorHandle, RollbackOutcome
from .constrained import ConstrainedDecode, GrammarFactory
from .errors import TokenLimitTooSmall
from .parsers import ToolCallParser, parser_for
from .trace import AnchorKind

if TYPE_CHECKING:
    from freetoken_agents.engine import Anchor, Engine

logger = logging.getLogger(__name__)

FENCE = "```"


class Usage(BaseModel):
    """Token work done by a backend (cumulative)."""

    prefilled: int = Field(default=0, description="tokens run through the model in batches")
    decoded: int = Field(default=0, description="tokens sampled and run one at a time")
    reused: int = Field(default=0, description="context tokens kept instead of recomputed on sync")
    saved_by_rollback: int = Field(default=0, description="prefix tokens kept by rollbacks")


class GenerateRequest(BaseModel):
    """One assistant turn. `force`: None (free), '*' (some tool must be called) or a tool name.

    Limits: `max_new_tokens` bounds the turn's free text (tokens sampled outside tool calls);
    `max_call_tokens` bounds the tokens sampled inside each tool call (what the schema forces,
    keys, punctuation and the call's markers, is prefilled and not counted). A call always closes
    its JSON inside that budget (the decoder steers towards closing near the end); a forced call
    whose schema cannot fit raises TokenLimitTooSmall before anything is decoded.

    `prefix` is text the turn starts with (assistant prefill): its tokens go through the same
    streaming checks as sampled ones, so a prefix that opens a code block or a tool call is anchored
    and constrained as if the model had written it. `logit_bias` maps token ids to values added to
    their logits while decoding freely (not inside grammar-constrained arguments).
    """

    model_config = ConfigDict(extra="forbid")

    tools: list[dict[str, Any]] = Field(default_factory=list)
    force: str | None = None
    constrain: bool = True
    max_new_tokens: int = Field(default=256, ge=0)
    max_call_tokens: int = Field(default=192, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    prefix: str = ""
    logit_bias: dict[int, float] = Field(default_factory=dict)


@dataclass(frozen=True)
class GenEvent:
    """A generation event: text delta, an anchor placed mid-turn, or the end of the turn."""

    kind: Literal["text", "anchor", "done"]
    text: str = ""
    anchor: AnchorHandle | None = None
    finish_reason: str | None = None


@runtime_checkable
class ModelBackend(Protocol):
    """What an Agent needs from a model.

    `rollback(anchor, validate=...)`: `validate` names how the backend checks the anchor's state
    before returning to it (the engine's modes; None: the backend's own default). The Agent passes
    it only when it was set, so a backend without validation modes may leave it out.
    """

    name: str
    parser: ToolCallParser

    @property
    def position(self) -> int: ...
    def render(
        self, messages: Sequence[dict], tools: Sequence[dict] | None, *, generation_prompt: bool = True
    ) -> list[int]: ...
    def sync(self, ids: Sequence[int]) -> None: ...
    def append_text(self, text: str) -> None: ...
    def generate(self, request: GenerateRequest) -> Iterator[GenEvent]: ...
    def anchor(self, kind: AnchorKind, label: str | None = None) -> AnchorHandle: ...
    def rollback(self, anchor: AnchorHandle) -> RollbackOutcome: ...
    def usage(self) -> Usage: ...
    def reset(self) -> None: ...


class FreeTokenModel:
    """The FreeToken engine as an agent backend: one session, native anchors when the engine has
    them (else token-id-validated truncation), xgrammar-constrained tool arguments.

    `validate`: how every rollback checks its anchor (passed to `Session.rollback(validate=...)`
    unchanged: the engine's modes, e.g. "signature" or "full"); None uses the engine's default.
    `session` is the engine session holding the context: read it, change it through this class.
    """

    def __init__(
        self, engine: Engine, *, family: str | None = None, max_anchors: int = 64, validate: str | None = None
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.name = f"freetoken:{engine.spec.model_type}"
        self.parser = parser_for(family, chat_template=getattr(self.tokenizer, "chat_template", None))
        self.stop_ids = tuple(engine.default_stop_token_ids())
        self.validate = validate
        self.anchors = AnchorBook(max_anchors, store=getattr(engine, "anchors", None))
        self.session = engine.new_session()
        self._usage = Usage()
        self._logits: torch.Tensor | None = None  # next-token logits [V] after the context, when known
        self._grammars: GrammarFactory | None = None

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        family: str | None = None,
        validate: str | None = None,
        **engine_options: Any,
    ) -> FreeTokenModel:
        """Load `path` with `Engine.from_pretrained(path, **engine_options)` (device, dtype,
        memory, placement, ... passed unchanged) and wrap it. `.engine` is the loaded engine."""
        from freetoken_agents.engine import Engine

        return cls(Engine.from_pretrained(path, **engine_options), family=family, validate=validate)

    # ---- context --------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        return self.session.position

    @property
    def token_ids(self) -> list[int]:
        return self.session.token_ids

    @property
    def max_context(self) -> int:
        """The most tokens the context may hold."""
        return self.engine.max_context

    @property
    def vocab_size(self) -> int:
        """Size of the logits vector (the model's vocabulary, padding included)."""
        return self.engine.spec.vocab_size

    def render(
        self, messages: Sequence[dict], tools: Sequence[dict] | None, *, generation_prompt: bool = True
    ) -> list[int]:
        return self.engine.apply_chat_template(messages, tools, add_generation_prompt=generation_prompt)

    def sync(self, ids: Sequence[int]) -> None:
        """Make the context exactly `ids`: keep the common prefix, drop the rest, prefill the tail."""
        ids = list(ids)
        current = self.session.token_ids
        keep = common_prefix_length(current, ids)
        if keep < len(current):
            self.truncate(keep)
        self._usage.reused += min(keep, self.session.cached_tokens)
        if keep < len(ids):
            self.prefill(ids[keep:])

    def append_text(self, text: str) -> None:
        if text:
            self.prefill(self.tokenizer.encode(text, add_special_tokens=False))

    def reset(self) -> None:
        """Start an empty context: forget (and discard) this model's anchors, release the KV."""
        self.anchors.clear()
        self._new_session()

    def usage(self) -> Usage:
        return self._usage.model_copy()

    # ---- model steps (the public seam for decoders) -----------------------------------------------
    def prefill(self, token_ids: Sequence[int]) -> None:
        """Append `token_ids` to the context and run them (one batch); next-token logits are ready."""
        ids = list(token_ids)
        if not ids:
            return
        before = self.session.cached_tokens
        self._logits = self.session.prefill(ids, last_only=True)[-1]
        self._usage.prefilled += self.session.cached_tokens - before

    def decode(self, token_id: int) -> None:
        """Append one sampled token and run it (counted as decoded)."""
        self._logits = self.session.decode(token_id)
        self._usage.decoded += 1

    def append_pending(self, token_id: int) -> None:
        """Append a token without running it yet (the stop token that ends a turn): it runs with
        the next prefill or decode, so ending a turn costs no model step."""
        self.session.append_unprocessed(token_id)
        self._logits = None

    def truncate(self, position: int) -> None:
        """Keep the first `position` tokens of the context (pointer work on the KV cache); anchors
        past it are forgotten."""
        self.session.truncate(position)
        self.anchors.forget_after(position)
        self._logits = None

    def next_logits(self) -> torch.Tensor:
        """Logits [V] for the token after the context (recomputes the last token if unknown)."""
        if self._logits is None:
            last = self.session.token_ids[-1]
            self.session.truncate(self.session.position - 1)
            self.prefill([last])
        assert self._logits is not None
        return self._logits

    # ---- anchors --------------------------------------------------------------------------------
    def anchor(self, kind: AnchorKind, label: str | None = None) -> AnchorHandle:
        return self.anchors.place(self.session, kind, label)

    def rollback(self, anchor: AnchorHandle, *, validate: str | None = None) -> RollbackOutcome:
        """Back to `anchor`, checked by `validate` (default: this model's `validate`). If the check
        fails, rebuild the anchor's prefix by prefill in a fresh session (rebuilt=True)."""
        start = self.session.position
        mode = validate if validate is not None else self.validate
        rebuilt = self.anchors.rollback(self.session, anchor, validate=mode)
        self._logits = None
        if rebuilt:
            self._new_session()
            self.anchors.forget_after(anchor.position)
            self.prefill(list(anchor.prefix))
            self.anchors.rebind(self.session, anchor)  # the rebuilt prefix is the anchored one
        else:
            self._usage.saved_by_rollback += anchor.position
        return RollbackOutcome(start, anchor.position, rebuilt)

    def pin(self, kind: AnchorKind = "manual", label: str | None = None) -> Anchor:
        """An engine anchor of the current context that this model does not hold: the caller owns
        it (a prefix cache) and discards it with `engine.anchors.discard(anchor.id)`."""
        return self.session.anchor(kind, label=label)

    def restore(self, anchor: Anchor, *, validate: str | None = None) -> None:
        """Make the context the state pinned by engine `anchor` (pointer work, no prefill),
        checked by `validate` (default: this model's). Raises the engine's AnchorNotFoundError /
        AnchorValidationError, leaving the context unchanged. This model's own anchors are
        forgotten (they belong to the branch left behind)."""
        mode = validate if validate is not None else self.validate
        if mode is None:
            self.session.rollback(anchor)
        else:
            self.session.rollback(anchor, validate=mode)
        self._logits = None
        self.anchors.forget_after(0)

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, request: GenerateRequest) -> Iterator[GenEvent]:
        from ._decode import TurnDecoder

        yield from TurnDecoder(self, request).run()

    def grammars(self) -> GrammarFactory:
        if self._grammars is None:
            self._grammars = GrammarFactory(self.tokenizer, self.vocab_size, self.stop_ids)
        return self._grammars

    def decode_json(
        self,
        schema: dict[str, Any],
        *,
        max_tokens: int,
        sampling: SamplingParams | None = None,
        end_turn: bool = True,
        limit_name: str = "max_tokens",
    ) -> Iterator[GenEvent]:
        """Decode one JSON value under `schema` after the context: text deltas, then a "done"
        event whose finish_reason is "stop" (always, unless the context itself ran out).

        The value closes within `max_tokens` sampled tokens (text the schema forces is prefilled
        and not counted); when even the schema's shortest value needs more, TokenLimitTooSmall
        (naming `limit_name`) is raised before anything is decoded. `sampling`: temperature /
        top_k / top_p / seed. `end_turn`: append the stop token afterwards (pending: it costs no
        model step).
        """
        call = ConstrainedDecode(
            self,
            self.grammars().json_schema(schema),
            budget=max_tokens,
            room=self.max_context - self.position - (1 if end_turn else 0),
            sampler=Sampler(sampling or SamplingParams()),
            tokenizer=self.tokenizer,
        )
        if call.min_tokens > max_tokens:
            raise TokenLimitTooSmall(
                f"{limit_name}={max_tokens} is too small for this schema: its shortest JSON value "
                f"takes {call.min_tokens} sampled tokens",
                limit=limit_name,
                value=max_tokens,
                needed=call.min_tokens,
            )
        for delta in call:
            if delta:
                yield GenEvent("text", delta)
        if end_turn and self.stop_ids:
            self.append_pending(self.stop_ids[0])
        yield GenEvent("done", finish_reason=call.finish_reason)

    # ---- internals ------------------------------------------------------------------------------
    def _new_session(self) -> None:
        self.session.close()
        self.session = self.engine.new_session()
        self._logits = None


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items `a` and `b` share: what a sync to `b` keeps of a context `a`."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
