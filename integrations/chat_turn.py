"""One chat turn on the engine, for every front end (ChatFreeToken, `freetoken serve`, `freetoken
chat`): prefix reuse, the SDK's turn decoder (tool calls decoded under their schemas' grammar,
forced ones included, stop strings: `GenerateRequest.stop`), its JSON decoder (structured
output) or its grammar decoder (a regex, an EBNF grammar, a choice; stop strings cut it too), the
cut at the first tool-call marker, and the calls parsed by the model's own parser.

`run_chat_turn` is a generator of typed events: `ContentDelta`s as text is decoded (text that may
begin a call marker is held back until it is known not to; the SDK holds back what may begin a
stop string), `ReasoningDelta`s (a thinking model's `<think>` block), a `ToolCallDone` as each
call's closing marker is decoded (malformed ones too, with their `error`: each front end decides
what to do with them), then one `Finished` with the finish reason and the usage. Between two
events it checks `cancelled()` and stops (finish_reason "cancelled") when the caller left.
With `ChatTurnRequest.logprobs`, the deltas (and `Finished`, for tokens whose text was no content
delta: tool calls, a held-back tail) carry each generated token's logprobs, in order.

`run_chat_choices` gives n replies to one prompt: the prompt is prefilled once, then each reply
decodes in a fork of that context (KV blocks shared), with its own seed; its events carry
`choice`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from freetoken_agents.constrained import TextGrammar
from freetoken_agents.engine import SamplingParams, held_back_for_stops
from freetoken_agents.model import GenerateRequest, GenEvent
from freetoken_agents.parsers import new_call_id

from .prefix_cache import PrefixCache, prepare_context, record_context
from .token_logprobs import TokenLogprobs, TokenTexts

if TYPE_CHECKING:
    from freetoken_agents.model import FreeTokenModel

__all__ = [
    "ChatTurnRequest",
    "ContentDelta",
    "Event",
    "Finished",
    "ReasoningDelta",
    "ToolCallDone",
    "run_chat_choices",
    "no_calls",
    "run_chat_turn",
]


def no_calls(backend: FreeTokenModel, logit_bias: dict[int, float]) -> dict[str, Any]:
    """tool_choice "none" as ChatTurnRequest fields (`ChatTurnRequest(ids=..., **no_calls(...))`,
    `logit_bias`: the request's own): the prompt offers its tools, the decoder lets no call start.
    It is the SDK decoder's relevant-calls gate with nothing relevant (`GenerateRequest.call_sources`:
    one tool no text is about, no texts): a call marker that is one token is masked, a longer one
    is cut where it began and its first token refused there (`_decode.TurnDecoder`), in every
    tool-call family; a call's end marker that is one token is masked too (refused its call, the
    embedded model wrote the end of one). Without it the tools the prompt showed were called anyway
    and their markup came back as content."""
    bias = dict(logit_bias)
    end = backend.tokenizer.encode(backend.parser.end, add_special_tokens=False) if backend.parser.end else []
    if len(end) == 1:
        bias[end[0]] = float("-inf")
    return {"tools": [{"type": "function", "function": {"name": ""}}], "call_sources": (), "logit_bias": bias}


@dataclass(frozen=True)
class ChatTurnRequest:
    """One turn's settings.

    ids: the prompt's token ids. tools: the tools the reply may call (empty: it calls none).
    force: None (the model decides), '*' (some tool must be called) or the forced tool's name.
    json_schema: the whole reply decodes under this schema (structured output; no tool calls, no
    stop strings). grammar: the whole reply decodes under this regex / EBNF grammar / choice (no
    tool calls; stop strings cut it, as vLLM's do). stop: stop strings for the free text (and a
    grammar reply). max_tokens: the bound on free text and a grammar reply;
    max_call_tokens: on each tool call's sampled tokens. json_limit: which of the two bounds a JSON
    reply (and is named when it cannot fit). argument_sources: ground tool-call string arguments in
    these texts (`GenerateRequest.argument_sources`; None: the grammar alone). call_sources: with
    the model deciding, call only tools these texts are about (`GenerateRequest.call_sources`).
    Sampling (temperature ... frequency_penalty, seed) goes to the engine's SamplingParams unchanged;
    logprobs: None, or N alternatives per generated token (`TokenLogprobs` on the events).
    """

    ids: list[int]
    tools: list[dict[str, Any]] = field(default_factory=list)
    force: str | None = None
    json_schema: dict[str, Any] | None = None
    grammar: TextGrammar | None = None
    stop: tuple[str, ...] = ()
    max_tokens: int = 256
    max_call_tokens: int = 192
    json_limit: Literal["max_tokens", "max_call_tokens"] = "max_tokens"
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    argument_sources: tuple[str, ...] | None = None
    call_sources: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ContentDelta:
    text: str
    after_calls: bool = False  # text the model wrote between or after its tool calls
    logprobs: tuple[TokenLogprobs, ...] = ()
    choice: int = 0  # which of `run_chat_choices`' replies


@dataclass(frozen=True)
class ReasoningDelta:
    text: str  # part of a thinking model's <think> block: `reasoning_content`, never the answer
    logprobs: tuple[TokenLogprobs, ...] = ()
    choice: int = 0


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
    choice: int = 0


@dataclass(frozen=True)
class Finished:
    """The turn's end. finish_reason: stop | length | tool_calls | cancelled; backend_reason: the
    decoder's own ("stop", "length", "memory"; None when it gave none)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    backend_reason: str | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # generated tokens no delta carried (tool calls)
    choice: int = 0


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
    yield from run_chat_choices(
        backend, cache, request, 1, reuse=reuse, record=record, cancelled=cancelled, tenant=tenant
    )


MAX_CHOICES = 8
"""Most replies one request may ask for (`run_chat_choices`' n): each holds its own KV."""


def run_chat_choices(
    backend: FreeTokenModel,
    cache: PrefixCache | None,
    request: ChatTurnRequest,
    n: int = 1,
    *,
    reuse: bool = True,
    record: bool = True,
    cancelled: Callable[[], bool] = lambda: False,
    tenant: str = "",
) -> Generator[Event, None, None]:
    """`n` replies to `request`, one after the other, each event tagged with its `choice` (one
    `Finished` per choice). The prompt is prefilled once (reused from `cache` as `run_chat_turn`
    does); reply 0 decodes in `backend`'s context (and is what `record` pins), replies 1..n-1 in
    forks of the prompt's context (`FreeTokenModel.fork`: KV blocks shared, no prefill), closed
    afterwards. Reply i samples with seed `request.seed + i` (vLLM's rule), or its own random seed
    when the request has none. ValueError for n outside [1, MAX_CHOICES]."""
    if not 1 <= n <= MAX_CHOICES:
        raise ValueError(f"n={n}: between 1 and {MAX_CHOICES} replies")
    cached = _prepare(backend, cache, request.ids, reuse=reuse, tenant=tenant)
    contexts = [backend] + [backend.fork() for _ in range(n - 1)]

    def pin_first() -> None:  # reply 0's context is the one a next request may continue
        if reuse and record and cache is not None:
            record_context(backend, cache, tenant)

    try:
        for i, context in enumerate(contexts):
            seed = None if request.seed is None else request.seed + i
            turn = dataclasses.replace(request, seed=seed)
            for event in _reply(context, turn, cached, cancelled, pin_first if i == 0 else lambda: None):
                yield dataclasses.replace(event, choice=i)
                if isinstance(event, Finished) and event.finish_reason == "cancelled":
                    return
    finally:
        for fork in contexts[1:]:
            fork.close()


def _prepare(
    backend: FreeTokenModel, cache: PrefixCache | None, ids: list[int], *, reuse: bool, tenant: str
) -> int:
    """Make the context `ids` with next-token logits ready; returns the prompt tokens reused."""
    if cache is not None:
        return prepare_context(backend, cache, ids, reuse=reuse, tenant=tenant)
    before = backend.usage().prefilled
    backend.sync(ids)
    backend.next_logits()
    return max(0, len(ids) - (backend.usage().prefilled - before))


def _reply(
    backend: FreeTokenModel,
    request: ChatTurnRequest,
    cached: int,
    cancelled: Callable[[], bool],
    on_end: Callable[[], None],
) -> Generator[Event, None, None]:
    """The reply's events, decoded after the context (already the prompt); `on_end` runs before
    the last `Finished` of a reply that was not cancelled."""
    ids = request.ids
    parser = backend.parser
    tools_on = bool(request.tools) and request.json_schema is None and request.grammar is None
    markers = (parser.start,) if tools_on and parser.start else ()
    full, emitted, finish, reason = "", 0, "length", None
    calls = _CallTracker(parser, request.tools if tools_on else [])
    lp = _Logprobs(backend, request.logprobs)
    events = _events(backend, request, tools_on)
    try:
        for event in events:
            if cancelled():
                finish = "cancelled"
                break
            lp.add(event)
            if event.kind == "done":
                # "memory" (the engine's KV budget ran out) and the like: the reply was cut short
                reason = event.finish_reason
                finish = reason if reason in ("stop", "length") else "length"
                continue
            if event.kind == "reasoning" and event.text:
                yield ReasoningDelta(event.text, lp.take())
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
                yield ContentDelta(full[emitted:visible], logprobs=lp.take())
                emitted = visible
            yield from calls.feed(full)
    finally:
        events.close()
    completion = max(0, backend.position - len(ids))  # the decoding is over: final
    if finish == "cancelled":
        yield Finished(finish, len(ids), completion, cached, reason)
        return
    if calls.start is None and emitted < len(full):
        # a held-back tail that turned out to be text
        yield ContentDelta(full[emitted:], logprobs=lp.take())
    if calls.start is not None:
        parsed = parser.parse(full[calls.start :], calls.tools)
        yield from calls.feed(full, parsed=parsed)
        if parsed.partial:
            yield calls.invalid("", parsed.partial, "unterminated tool call", parsed.partial)
        if parsed.content:
            yield ContentDelta(parsed.content, after_calls=True, logprobs=lp.take())
    if calls.done:
        finish = "tool_calls"
    on_end()
    yield Finished(finish, len(ids), completion, cached, reason, lp.take())


class _Logprobs:
    """The engine's logprob entries of a reply, waiting for the next event to carry them, as
    `TokenLogprobs` (text and bytes: `TokenTexts`)."""

    def __init__(self, backend: FreeTokenModel, top_n: int | None) -> None:
        self.texts = TokenTexts(backend) if top_n is not None else None
        self.entries: list[Any] = []

    def add(self, event: GenEvent) -> None:
        self.entries.extend(event.logprobs)

    def take(self) -> tuple[TokenLogprobs, ...]:
        if self.texts is None or not self.entries:
            return ()
        out = self.texts.convert(self.entries)
        self.entries = []
        return out


def _events(backend: FreeTokenModel, request: ChatTurnRequest, tools_on: bool) -> Iterator[GenEvent]:
    sampling = dict(
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        seed=request.seed,
        logprobs=request.logprobs,
    )
    if request.grammar is not None:
        events = backend.decode_grammar(
            request.grammar, max_tokens=request.max_tokens, sampling=SamplingParams(**sampling)
        )
        return _until_stop(events, request.stop) if request.stop else events
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


def _until_stop(events: Iterator[GenEvent], stops: tuple[str, ...]) -> Iterator[GenEvent]:
    """A grammar reply's events cut at its first stop string: text that may begin one is held
    back, the text before it delivered, then "done" with "stop" (the stop string and what the
    grammar decoder had written past it are dropped; their tokens stay in the context, as the SDK
    leaves a free turn's)."""
    text, sent = "", 0
    try:
        for event in events:
            if event.kind != "text":
                if event.kind == "done" and sent < len(text):  # the held-back tail was text
                    yield GenEvent("text", text[sent:])
                yield event
                continue
            text += event.text
            # text[:sent] holds no stop, nor the start of one (that would have been held back)
            found = [i for i in (text.find(stop, sent) for stop in stops) if i != -1]
            if found:
                yield GenEvent("text", text[sent : min(found)], logprobs=event.logprobs)
                yield GenEvent("done", finish_reason="stop")
                return
            visible = len(text) - held_back_for_stops(text, stops)
            yield GenEvent("text", text[sent:visible], logprobs=event.logprobs)
            sent = visible
    finally:
        events.close()


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
