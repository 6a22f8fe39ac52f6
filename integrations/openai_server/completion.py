"""One chat completion on the engine: prefix reuse, the SDK's turn decoder (tool calls decoded under
their schemas' grammar, forced ones included) or its JSON decoder (response_format), stop strings,
and tool calls parsed by the model's own parser into OpenAI `tool_calls`.

`run_completion` is a generator of events the HTTP side turns into a response or SSE chunks:
`ContentDelta`s as text is decoded (text that may begin a call marker or a stop string is held
back until it is known not to), a `ToolCallDone` as each call's closing marker is decoded, then
one `Finished` with the finish reason and usage. It runs on the engine worker's thread; between
two events it checks `cancelled()` and stops (finish_reason "cancelled") when the client left.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from freetoken_agents.engine import SamplingParams, held_back_for_stops
from freetoken_agents.errors import TokenLimitTooSmall
from freetoken_agents.model import GenerateRequest, GenEvent

from ..prefix_cache import PrefixCache, prepare_context, record_context
from .errors import bad_request
from .prepare import PreparedRequest
from .schemas import call_id

if TYPE_CHECKING:
    from freetoken_agents.model import FreeTokenModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str  # part of a thinking model's <think> block: `reasoning_content`, never the answer


@dataclass(frozen=True)
class ToolCallDone:
    index: int
    id: str
    name: str
    arguments: str  # JSON object text


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # stop | length | tool_calls | cancelled
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


Event = ContentDelta | ReasoningDelta | ToolCallDone | Finished


def _events(backend: FreeTokenModel, req: PreparedRequest) -> Iterator[GenEvent]:
    sampling = dict(temperature=req.temperature, top_p=req.top_p, seed=req.seed)
    if req.json_schema is not None:
        return backend.decode_json(
            req.json_schema, max_tokens=req.max_tokens, sampling=SamplingParams(**sampling)
        )
    return backend.generate(
        GenerateRequest(
            tools=req.tools if req.tools_on else [],
            force=req.force if req.tools_on else None,
            max_new_tokens=req.max_tokens,
            max_call_tokens=req.max_tokens,
            logit_bias=req.logit_bias,
            **sampling,
        )
    )


def run_completion(
    backend: FreeTokenModel,
    cache: PrefixCache,
    req: PreparedRequest,
    *,
    reuse: bool,
    cancelled: Callable[[], bool] = lambda: False,
    tenant: str = "",
) -> Iterator[Event]:
    """Generate the reply to `req` (see the module docstring). Raises OpenAIError (400) when a
    forced call or a JSON reply cannot close inside max_tokens. Prefix reuse is `tenant`'s own."""
    cached = prepare_context(backend, cache, req.ids, reuse=reuse, tenant=tenant)
    parser = backend.parser
    stops = req.stop if req.json_schema is None else ()
    markers = (*stops, parser.start) if req.tools_on else stops
    full, emitted, finish, stopped = "", 0, "length", False
    calls = _CallTracker(parser, req.tools if req.tools_on else [])
    events = _events(backend, req)
    try:
        for event in _guard(events):
            if cancelled():
                finish = "cancelled"
                break
            if event.kind == "done":
                # "memory" (the engine's KV budget ran out) and the like: the reply was cut short
                finish = event.finish_reason if event.finish_reason in ("stop", "length") else "length"
                continue
            if event.kind == "reasoning" and event.text:
                yield ReasoningDelta(event.text)
                continue
            if event.kind != "text" or not event.text:
                continue
            full += event.text
            if req.tools_on and calls.start is None:
                calls.start = parser.call_started(full, emitted)
            cut = calls.start if calls.start is not None else len(full)
            hit = [j for j in (full.find(s, max(0, emitted - len(s))) for s in stops) if 0 <= j < cut]
            if hit:
                cut = min(hit)
            visible = (
                cut if (hit or calls.start is not None) else cut - held_back_for_stops(full[:cut], markers)
            )
            if visible > emitted:
                yield ContentDelta(full[emitted:visible])
                emitted = visible
            if hit:
                finish, stopped = "stop", True
                break
            yield from calls.feed(full)
    finally:
        events.close()
    if finish == "cancelled":
        yield Finished(finish, len(req.ids), max(0, backend.position - len(req.ids)), cached)
        return
    if calls.start is None and not stopped and emitted < len(full):
        yield ContentDelta(full[emitted:])  # a held-back tail that turned out to be text
    if calls.start is not None:
        parsed = parser.parse(full[calls.start :], calls.tools)
        yield from calls.feed(full, parsed=parsed)
        if parsed.content:  # text the model wrote between or after its calls
            yield ContentDelta(("\n" if emitted else "") + parsed.content)
    if calls.done:
        finish = "tool_calls"
    if reuse:
        record_context(backend, cache, tenant)
    yield Finished(finish, len(req.ids), max(0, backend.position - len(req.ids)), cached)


def _guard(events: Iterator[GenEvent]) -> Iterator[GenEvent]:
    """The decoder's events; its TokenLimitTooSmall (a forced call or JSON reply whose shortest
    value does not fit max_tokens) becomes a 400 naming the limit."""
    try:
        yield from events
    except TokenLimitTooSmall as e:
        raise bad_request(str(e).replace("max_call_tokens", "max_tokens"), param="max_tokens") from e


class _CallTracker:
    """Reports each tool call once, as soon as its closing marker is decoded. `start`: where the
    first call marker is in the turn's text (None until one appears); `tools`: the request's tools,
    which type the values of some families' calls (`ToolCallParser.parse`)."""

    def __init__(self, parser: Any, tools: list[dict[str, Any]]) -> None:
        self.parser = parser
        self.tools = tools
        self.start: int | None = None
        self.parsed = 0  # calls of the parse consumed (malformed ones included)
        self.done = 0  # calls reported
        self.ends = 0  # closing markers seen
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
            self.ends += found
            parsed = self.parser.parse(text[self.start :], self.tools)
        for call in parsed.calls[self.parsed :]:
            self.parsed += 1
            if call.error or not isinstance(call.arguments, dict):
                logger.warning("dropping a malformed tool call %r: %s", call.raw[:80], call.error)
                continue
            arguments = json.dumps(call.arguments, ensure_ascii=False)
            yield ToolCallDone(self.done, call_id(), call.name, arguments)
            self.done += 1
