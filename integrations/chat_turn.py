"""One chat turn on the engine, for every front end (ChatFreeToken, `freetoken serve`, `freetoken
chat`): prefix reuse, the SDK's turn decoder (tool calls decoded under their schemas' grammar,
forced ones included, stop strings: `GenerateRequest.stop`) or its JSON decoder (structured
output), the cut at the first tool-call marker, and the calls parsed by the model's own parser.

`run_chat_turn` is a generator of typed events: `ContentDelta`s as text is decoded (text that may
begin a call marker is held back until it is known not to; the SDK holds back what may begin a
stop string), `ReasoningDelta`s (a thinking model's `<think>` block), a `ToolCallDone` as each
call's closing marker is decoded (malformed ones too, with their `error`: each front end decides
what to do with them), then one `Finished` with the finish reason and the usage. Between two
events it checks `cancelled()` and stops (finish_reason "cancelled") when the caller left.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from freetoken_agents.engine import SamplingParams, held_back_for_stops
from freetoken_agents.model import GenerateRequest, GenEvent
from freetoken_agents.parsers import new_call_id

from .prefix_cache import PrefixCache, prepare_context, record_context

if TYPE_CHECKING:
    from freetoken_agents.model import FreeTokenModel

__all__ = [
    "ChatTurnRequest",
    "ContentDelta",
    "Event",
    "Finished",
    "ReasoningDelta",
    "ToolCallDone",
    "run_chat_turn",
]


@dataclass(frozen=True)
class ChatTurnRequest:
    """One turn's settings.

    ids: the prompt's token ids. tools: the tools the reply may call (empty: it calls none).
    force: None (the model decides), '*' (some tool must be called) or the forced tool's name.
    json_schema: the whole reply decodes under this schema (structured output; no tool calls, no
    stop strings). stop: stop strings for the free text. max_tokens: the bound on free text;
    max_call_tokens: on each tool call's sampled tokens. json_limit: which of the two bounds a JSON
    reply (and is named when it cannot fit). argument_sources: ground tool-call string arguments in
    these texts (`GenerateRequest.argument_sources`; None: the grammar alone). call_sources: with
    the model deciding, call only tools these texts are about (`GenerateRequest.call_sources`).
    """

    ids: list[int]
    tools: list[dict[str, Any]] = field(default_factory=list)
    force: str | None = None
    json_schema: dict[str, Any] | None = None
    stop: tuple[str, ...] = ()
    max_tokens: int = 256
    max_call_tokens: int = 192
    json_limit: Literal["max_tokens", "max_call_tokens"] = "max_tokens"
    temperature: float = 0.0
    top_p: float | None = None
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    argument_sources: tuple[str, ...] | None = None
    call_sources: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ContentDelta:
    text: str
    after_calls: bool = False  # text the model wrote between or after its tool calls


@dataclass(frozen=True)
class ReasoningDelta:
    text: str  # part of a thinking model's <think> block: `reasoning_content`, never the answer


@dataclass(frozen=True)
class ToolCallDone:
    """A tool call, reported once it closed (or, unterminated, when the turn ended).

    Valid (`error` None): `arguments` is the JSON object text, `args` the object; `index` counts
    the turn's valid calls. Invalid: `error` says why, `arguments` is the text as written (or
    JSON), `index` counts the turn's invalid calls; `raw` is the call's whole text.
    """

    index: int
    id: str
    name: str
    arguments: str
    error: str | None = None
    args: Any = None
    raw: str = ""


@dataclass(frozen=True)
class Finished:
    """The turn's end. finish_reason: stop | length | tool_calls | cancelled; backend_reason: the
    decoder's own ("stop", "length", "memory"; None when it gave none)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    backend_reason: str | None = None


Event = ContentDelta | ReasoningDelta | ToolCallDone | Finished


def run_chat_turn(
    backend: FreeTokenModel,
    cache: PrefixCache | None,
    request: ChatTurnRequest,
    *,
    reuse: bool = True,
    record: bool = True,
    cancelled: Callable[[], bool] = lambda: False,
    tenant: str = "",
) -> Generator[Event, None, None]:
    """Generate the reply to `request` (see the module docstring). Prefix reuse is `tenant`'s own;
    with `reuse` and `record` the whole context (prompt and reply) is pinned in `cache` afterwards
    (one anchor per turn: worth it where one context serves many conversations, as the server's
    does). `cache` None: the caller keeps the context itself (its anchors stay), it is only
    synced to the prompt.
    Raises TokenLimitTooSmall when a forced call or a JSON reply cannot close inside its bound."""
    ids = request.ids
    if cache is None:
        before = backend.usage().prefilled
        backend.sync(ids)
        backend.next_logits()
        cached = max(0, len(ids) - (backend.usage().prefilled - before))
    else:
        cached = prepare_context(backend, cache, ids, reuse=reuse, tenant=tenant)
    parser = backend.parser
    tools_on = bool(request.tools) and request.json_schema is None
    markers = (parser.start,) if tools_on and parser.start else ()
    full, emitted, finish, reason = "", 0, "length", None
    calls = _CallTracker(parser, request.tools if tools_on else [])
    events = _events(backend, request, tools_on)
    try:
        for event in events:
            if cancelled():
                finish = "cancelled"
                break
            if event.kind == "done":
                # "memory" (the engine's KV budget ran out) and the like: the reply was cut short
                reason = event.finish_reason
                finish = reason if reason in ("stop", "length") else "length"
                continue
            if event.kind == "reasoning" and event.text:
                yield ReasoningDelta(event.text)
                continue
            if event.kind != "text" or not event.text:
                continue
            full += event.text
            if tools_on and calls.start is None:
                calls.start = parser.call_started(full, emitted)
            if calls.start is not None:
                visible = calls.start
            else:
                visible = len(full) - held_back_for_stops(full, markers)
            if visible > emitted:
                yield ContentDelta(full[emitted:visible])
                emitted = visible
            yield from calls.feed(full)
    finally:
        events.close()
    completion = max(0, backend.position - len(ids))  # the decoding is over: final
    if finish == "cancelled":
        yield Finished(finish, len(ids), completion, cached, reason)
        return
    if calls.start is None and emitted < len(full):
        yield ContentDelta(full[emitted:])  # a held-back tail that turned out to be text
    if calls.start is not None:
        parsed = parser.parse(full[calls.start :], calls.tools)
        yield from calls.feed(full, parsed=parsed)
        if parsed.partial:
            yield calls.invalid("", parsed.partial, "unterminated tool call", parsed.partial)
        if parsed.content:
            yield ContentDelta(parsed.content, after_calls=True)
    if calls.done:
        finish = "tool_calls"
    if reuse and record and cache is not None:
        record_context(backend, cache, tenant)
    yield Finished(finish, len(ids), completion, cached, reason)


def _events(backend: FreeTokenModel, request: ChatTurnRequest, tools_on: bool) -> Iterator[GenEvent]:
    sampling = dict(temperature=request.temperature, top_p=request.top_p, seed=request.seed)
    if request.json_schema is not None:
        limit = request.json_limit
        return backend.decode_json(
            request.json_schema,
            max_tokens=getattr(request, limit),
            sampling=SamplingParams(**sampling),
            limit_name=limit,
        )
    return backend.generate(
        GenerateRequest(
            tools=request.tools if tools_on else [],
            force=request.force if tools_on else None,
            max_new_tokens=request.max_tokens,
            max_call_tokens=request.max_call_tokens,
            logit_bias=request.logit_bias,
            stop=list(request.stop),
            argument_sources=None if request.argument_sources is None else list(request.argument_sources),
            call_sources=None if request.call_sources is None else list(request.call_sources),
            **sampling,
        )
    )


class _CallTracker:
    """Reports each tool call once, as soon as its closing marker is decoded. `start`: where the
    first call marker is in the turn's text (None until one appears); `tools`: the request's tools,
    which type the values of some families' calls (`ToolCallParser.parse`)."""

    def __init__(self, parser: Any, tools: list[dict[str, Any]]) -> None:
        self.parser = parser
        self.tools = tools
        self.start: int | None = None
        self.parsed = 0  # calls of the parse consumed (malformed ones included)
        self.done = 0  # valid calls reported
        self.bad = 0  # invalid calls reported
        self.searched = 0  # chars of the text searched for closing markers

    def feed(self, text: str, parsed: Any = None) -> Iterator[ToolCallDone]:
        """New complete calls in `text`; `parsed`: the final parse of text[start:] (the turn ended)."""
        if self.start is None:
            return
        if parsed is None:
            end = self.parser.end
            if not end:
                return  # calls of this format are known complete only when the turn ends
            found = text.count(end, max(self.start, self.searched - len(end) + 1))
            self.searched = len(text)
            if not found:
                return
            parsed = self.parser.parse(text[self.start :], self.tools)
        for call in parsed.calls[self.parsed :]:
            self.parsed += 1
            if call.error or not isinstance(call.arguments, dict):
                args = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
                yield self.invalid(call.name or "", args, call.error, call.raw)
                continue
            arguments = json.dumps(call.arguments, ensure_ascii=False)
            yield ToolCallDone(
                self.done, new_call_id(), call.name, arguments, args=call.arguments, raw=call.raw
            )
            self.done += 1

    def invalid(self, name: str, arguments: str, error: str | None, raw: str) -> ToolCallDone:
        self.bad += 1
        error = error or "the arguments are not a JSON object"
        return ToolCallDone(self.bad - 1, new_call_id(), name, arguments, error=error, raw=raw)
