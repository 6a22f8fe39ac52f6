"""A model for testing agents without weights: `ScriptedModel` plays scripted assistant turns.

    from freetoken_agents import Agent, tool
    from freetoken_agents.testing import ScriptedModel, ToolCall

    model = ScriptedModel([ToolCall("get_weather", {"city": "Paris"}), "It is sunny in Paris."])
    result = Agent(model, [get_weather]).run("Weather in Paris?")
    assert model.remaining == 0 and result.output == "It is sunny in Paris."

It implements the same `ModelBackend` protocol as `FreeTokenModel`, so the agent's loop runs
unchanged: tool calls are written in the parser's own format and parsed back, anchors are placed
(system prompt, tool call, tool result, code block), a failed call rolls back to the anchor before
it and the failure note is appended. Its "tokens" are characters: `usage()` counts characters
prefilled, generated and kept, and `contexts` holds the context each turn was generated from, so a
test can check what the model saw (e.g. the failure note after a rollback).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .anchors import AnchorBook, AnchorHandle, RollbackOutcome
from .backend import BackendBase, GenerateRequest, GenEvent, Usage, common_prefix_length
from .engine.text.stop_text import first_stop
from .errors import UnexpectedModelBehavior
from .parsers import ToolCallParser, parser_for
from .trace import AnchorKind

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    """A scripted tool call. `arguments` is a dict (JSON-encoded) or the exact arguments text;
    `raw`, when set, is the exact text between the call's markers (to script malformed calls)."""

    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)
    raw: str | None = None


Part = str | ToolCall
Turn = str | ToolCall | Sequence[Part] | Callable[[GenerateRequest, str], Any]
"""A scripted turn: text, a call, a sequence of both (in order), or a callable
`(request, context_text) -> Turn` deciding when the turn is played."""


class _TextSession:
    """The context as characters; what AnchorBook needs of a session (no native anchors)."""

    def __init__(self) -> None:
        self.chars: list[int] = []

    @property
    def token_ids(self) -> list[int]:
        return list(self.chars)

    @property
    def position(self) -> int:
        return len(self.chars)

    def truncate(self, position: int) -> None:
        del self.chars[position:]


class ScriptedModel(BackendBase):
    """A `ModelBackend` playing `turns` in order, one per `generate` call (across runs: `reset`
    clears the context, not the script). Raises UnexpectedModelBehavior when the script runs out,
    or when a turn cannot honour the request (no call where tool_choice forces one, a call of
    another tool than the forced one, a call when tool_choice is 'none').

    `family` picks the tool-call format (default Hermes, the engine's); `chunk` is how many
    characters each streamed text event carries.

    Its capabilities are `BackendBase`'s: one context (an Agent's runs take turns on it, so a test
    reads every run's requests and contexts here), no known context size.
    """

    def __init__(
        self,
        turns: Iterable[Turn],
        *,
        family: str | None = None,
        chunk: int = 8,
        max_anchors: int = 64,
        name: str = "scripted",
    ) -> None:
        self.turns: list[Turn] = list(turns)
        self.name = name
        self.parser: ToolCallParser = parser_for(family)
        self.chunk = max(1, chunk)
        self.anchors = AnchorBook(max_anchors)
        self.requests: list[GenerateRequest] = []  # every request, in order
        self.contexts: list[str] = []  # the context text each turn was generated from
        self.validations: list[str | None] = []  # the `validate` of every rollback, in order
        self._session = _TextSession()
        self._usage = Usage()
        self._played = 0

    # ---- context ------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        return self._session.position

    @property
    def text(self) -> str:
        """The current context as text."""
        return "".join(map(chr, self._session.chars))

    @property
    def remaining(self) -> int:
        """Scripted turns not played yet."""
        return len(self.turns) - self._played

    def render(
        self, messages: Sequence[dict], tools: Sequence[dict] | None, *, generation_prompt: bool = True
    ) -> list[int]:
        """A simple chat rendering (tools first, one block per message), as character codes."""
        parts = [f"<|tools|>{json.dumps(list(tools), sort_keys=True)}<|end|>\n"] if tools else []
        for message in messages:
            content = message.get("content") or ""
            for call in message.get("tool_calls") or []:
                fn = call.get("function", call)
                content += self._format_call(ToolCall(fn["name"], fn.get("arguments") or {}))
            parts.append(f"<|{message['role']}|>{content}<|end|>\n")
        if generation_prompt:
            parts.append("<|assistant|>")
        return _encode("".join(parts))

    def sync(self, ids: Sequence[int]) -> None:
        """Make the context exactly `ids`, keeping the common prefix (counted as reused)."""
        ids, current = list(ids), self._session.chars
        keep = common_prefix_length(current, ids)
        if keep < len(current):
            self._session.truncate(keep)
            self.anchors.forget_after(keep)
        self._usage.reused += keep
        self._session.chars.extend(ids[keep:])
        self._usage.prefilled += len(ids) - keep

    def append_text(self, text: str) -> None:
        self._session.chars.extend(_encode(text))
        self._usage.prefilled += len(text)

    def reset(self) -> None:
        self.anchors.clear()
        self._session = _TextSession()

    def usage(self) -> Usage:
        return self._usage.model_copy()

    # ---- anchors ------------------------------------------------------------------------------
    def anchor(self, kind: AnchorKind, label: str | None = None) -> AnchorHandle:
        return self.anchors.place(self._session, kind, label)

    def rollback(self, anchor: AnchorHandle, *, validate: str | None = None) -> RollbackOutcome:
        """Back to `anchor`; a changed prefix is rebuilt from the anchor's record (rebuilt=True).
        `validate` is accepted and recorded in `validations`: a text context is always checked by
        comparing its characters with the anchor's."""
        self.validations.append(validate)
        start = self.position
        rebuilt = self.anchors.rollback(self._session, anchor)
        if rebuilt:
            self._session.chars = list(anchor.prefix)
            self._usage.prefilled += len(anchor.prefix)
            self.anchors.forget_after(anchor.position)
            self.anchors.rebind(self._session, anchor)
        else:
            self._usage.saved_by_rollback += anchor.position
        return RollbackOutcome(start, anchor.position, rebuilt)

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, request: GenerateRequest) -> Generator[GenEvent, None, None]:
        """Play the next scripted turn: text in `chunk`-sized events, an anchor before each tool
        call and before each code fence the text opens."""
        from ._fences import opening_fences

        if self._played >= len(self.turns):
            raise UnexpectedModelBehavior(
                f"ScriptedModel ran out of turns after {len(self.turns)} (add more to the script)"
            )
        self.requests.append(request)
        self.contexts.append(self.text)
        turn = self.turns[self._played]
        self._played += 1
        if callable(turn):
            turn = turn(request, self.text)
        parts = _cut_at_stop(self._check(_parts(turn), request), request.stop)
        turn_text = ""
        for part in parts:
            if isinstance(part, ToolCall):
                yield GenEvent("anchor", anchor=self.anchor("tool_call", label=part.name))
                segments = [self._format_call(part)]
            else:
                seen = len(opening_fences(turn_text))
                cuts = [i - len(turn_text) for i in opening_fences(turn_text + part)[seen:]]
                segments = [part[a:b] for a, b in zip([0, *cuts], [*cuts, len(part)], strict=True)]
            for i, segment in enumerate(segments):
                if i > 0:  # a fence opens here
                    yield GenEvent("anchor", anchor=self.anchor("code_block"))
                for j in range(0, len(segment), self.chunk):
                    piece = segment[j : j + self.chunk]
                    self._session.chars.extend(_encode(piece))
                    self._usage.decoded += len(piece)
                    yield GenEvent("text", piece)
                turn_text += segment
        yield GenEvent("done", finish_reason="stop")

    # ---- internals ----------------------------------------------------------------------------
    def _check(self, parts: list[Part], request: GenerateRequest) -> list[Part]:
        calls = [p for p in parts if isinstance(p, ToolCall)]
        where = f"scripted turn {self._played}"
        if request.force is not None and request.tools and not calls:
            raise UnexpectedModelBehavior(f"{where} has no tool call, but tool_choice forces one")
        if request.force not in (None, "*") and any(c.name != request.force for c in calls):
            raise UnexpectedModelBehavior(f"{where} calls another tool than the forced {request.force!r}")
        if calls and not request.tools:
            raise UnexpectedModelBehavior(f"{where} calls a tool, but the request offers none")
        return parts

    def _format_call(self, call: ToolCall) -> str:
        p = self.parser
        if call.raw is None and isinstance(call.arguments, dict):
            return p.format_call(call.name, call.arguments)  # the family's own form (XML for some)
        body = call.raw if call.raw is not None else call.arguments
        if call.raw is None and not p.needs_name_in_prefix():
            body = f'{{"name": {json.dumps(call.name)}, "arguments": {call.arguments}}}'
        return p.call_prefix(call.name) + body + p.call_suffix()


def _parts(turn: Any) -> list[Part]:
    if isinstance(turn, (str, ToolCall)):
        return [turn]
    parts = list(turn)
    for p in parts:
        if not isinstance(p, (str, ToolCall)):
            raise TypeError(f"a scripted turn holds text and ToolCall items, got {type(p).__name__}")
    return parts


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


__all__ = ["Part", "ScriptedModel", "ToolCall", "Turn"]


def _cut_at_stop(parts: list[Part], stops: Sequence[str]) -> list[Part]:
    """The scripted turn up to the first of `stops` (`GenerateRequest.stop`) in its free text
    before its first tool call, as the engine's turn decoder ends a turn there."""
    text = ""
    for i, part in enumerate(parts):
        if isinstance(part, ToolCall):
            break
        text += part
        at = first_stop(text, stops)
        if at is not None:
            kept: list[Part] = []
            for piece in parts[: i + 1]:
                if at <= 0:
                    break
                kept.append(piece[:at])  # type: ignore[index]
                at -= len(piece)  # type: ignore[arg-type]
            return kept
    return parts
