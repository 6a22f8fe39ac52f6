"""The backend protocol the Agent talks to, and FreeTokenModel, its implementation over the engine.

The protocol is narrow on purpose (render, sync/prefill, generate, anchor, rollback, usage) so an
OpenAI-compatible server with prefix caching can follow: there rollback means "resend the kept
prefix" and the server's prefix cache absorbs it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from .anchors import AnchorBook, AnchorHandle, RollbackOutcome
from .constrained import GrammarFactory
from .parsers import ToolCallParser, parser_for
from .trace import AnchorKind

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

    `prefix` is text the turn starts with (assistant prefill): its tokens go through the same
    streaming checks as sampled ones, so a prefix that opens a code block or a tool call is anchored
    and constrained as if the model had written it. `logit_bias` maps token ids to values added to
    their logits while decoding freely (not inside grammar-constrained arguments).
    """

    model_config = ConfigDict(extra="forbid")

    tools: list[dict[str, Any]] = Field(default_factory=list)
    force: str | None = None
    constrain: bool = True
    max_new_tokens: int = 256
    max_call_tokens: int = 192
    temperature: float = 0.0
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
    """What an Agent needs from a model."""

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
    them (else token-id-validated truncation), xgrammar-constrained tool arguments."""

    def __init__(self, engine: Any, *, family: str | None = None, max_anchors: int = 64) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.name = f"freetoken:{engine.spec.model_type}"
        self.parser = parser_for(family, chat_template=getattr(self.tokenizer, "chat_template", None))
        self.stop_ids = tuple(engine.default_stop_token_ids())
        self.anchors = AnchorBook(max_anchors, store=getattr(engine, "anchors", None))
        self.session = engine.new_session()
        self._usage = Usage()
        self._logits: Any = None  # next-token logits [V] at the end of the context, when known
        self._grammars: GrammarFactory | None = None

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, family: str | None = None, **engine_kwargs: Any
    ) -> FreeTokenModel:
        from freetoken_agents.engine import Engine

        return cls(Engine.from_pretrained(path, **engine_kwargs), family=family)

    # ---- context --------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        return self.session.position

    @property
    def token_ids(self) -> list[int]:
        return self.session.token_ids

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
            self.session.truncate(keep)
            self.anchors.forget_after(keep)
            self._logits = None
        self._usage.reused += min(keep, self.session.cached_tokens)
        if keep < len(ids):
            self._prefill(ids[keep:])

    def append_text(self, text: str) -> None:
        if text:
            self._prefill(self.tokenizer.encode(text, add_special_tokens=False))

    def reset(self) -> None:
        """Start an empty context: forget (and discard) this model's anchors, release the KV."""
        self.anchors.clear()
        self.session.close()
        self.session = self.engine.new_session()
        self._logits = None

    def usage(self) -> Usage:
        return self._usage.model_copy()

    # ---- anchors --------------------------------------------------------------------------------
    def anchor(self, kind: AnchorKind, label: str | None = None) -> AnchorHandle:
        return self.anchors.place(self.session, kind, label)

    def rollback(self, anchor: AnchorHandle) -> RollbackOutcome:
        """Back to `anchor`. If it fails validation, rebuild its prefix by prefill (rebuilt=True)."""
        start = self.session.position
        rebuilt = self.anchors.rollback(self.session, anchor)
        if rebuilt:
            self.session.close()
            self.session = self.engine.new_session()
            self.anchors.forget_after(anchor.position)
            self._logits = None
            if anchor.prefix:
                self._prefill(list(anchor.prefix))
            self.anchors.rebind(self.session, anchor)  # the rebuilt prefix is the anchored one
        else:
            self._usage.saved_by_rollback += anchor.position
            self._logits = None
        return RollbackOutcome(start, anchor.position, rebuilt)

    # ---- generation -----------------------------------------------------------------------------
    def next_logits(self) -> Any:
        """Logits [V] for the token after the context (recomputes the last token if unknown)."""
        if self._logits is None:
            last = self.session.token_ids[-1]
            self.session.truncate(self.session.position - 1)
            self._prefill([last])
        return self._logits

    def generate(self, request: GenerateRequest) -> Iterator[GenEvent]:
        from ._decode import TurnDecoder

        yield from TurnDecoder(self, request).run()

    def grammars(self) -> GrammarFactory:
        if self._grammars is None:
            self._grammars = GrammarFactory(self.tokenizer, self.engine.spec.vocab_size, self.stop_ids)
        return self._grammars

    # ---- internals ------------------------------------------------------------------------------
    def _prefill(self, ids: list[int]) -> None:
        before = self.session.cached_tokens
        self._logits = self.session.prefill(ids, last_only=True)[-1]
        self._usage.prefilled += self.session.cached_tokens - before

    def _decode(self, token_id: int) -> None:
        self._logits = self.session.decode(token_id)
        self._usage.decoded += 1


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items `a` and `b` share: what a sync to `b` keeps of a context `a`."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
