"""One assistant turn for LangChain: prefix reuse, generation, stop strings, tool-call parsing.

`run_turn` is a plain generator of `AIMessageChunk`s: content deltas as they are decoded, then
one chunk with the tool calls (`tool_call_chunks`, each with an index) or `invalid_tool_calls`,
then a last chunk (`chunk_position="last"`) carrying `usage_metadata` and `response_metadata`.
Every `next()` runs at most one engine step (a decode, or one forced stretch), so async callers
advance it in a worker thread per step. The engine lock is held from the first step to the end.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import AIMessageChunk
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk

from freetoken_agents.constrained import resolve_tool_choice
from freetoken_agents.engine import SamplingParams, held_back_for_stops
from freetoken_agents.model import GenerateRequest
from freetoken_agents.parsers import new_call_id

from ..prefix_cache import prepare_context
from .engines import EngineHandle

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnOptions:
    """Per-call settings. force_choice: 'auto' | 'none' | 'required' | a tool name; json_schema:
    constrain the whole turn to this JSON schema (structured output)."""

    model_name: str
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"
    json_schema: dict[str, Any] | None = None
    stop: tuple[str, ...] = ()
    max_tokens: int = 256
    max_call_tokens: int = 192
    temperature: float = 0.0
    seed: int | None = None
    reuse: bool = True


@dataclass
class TurnState:
    """What a finished turn produced (for `_generate`, which builds one AIMessage)."""

    content: str = ""
    reasoning: str = ""  # a thinking model's <think> block (additional_kwargs["reasoning_content"])
    tool_calls: list[dict] = field(default_factory=list)
    invalid_tool_calls: list[dict] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    response_metadata: dict[str, Any] = field(default_factory=dict)


def _call_id() -> str:
    return new_call_id()  # nine letters and digits: what every chat template accepts


def run_turn(
    handle: EngineHandle, ids: list[int], opts: TurnOptions, state: TurnState | None = None
) -> Iterator[AIMessageChunk]:
    """Generate one assistant turn after prompt `ids` (see the module docstring)."""
    state = state if state is not None else TurnState()
    backend = handle.backend
    handle.lock.acquire()
    try:
        cache_read = prepare_context(backend, handle.cache, ids, reuse=opts.reuse)
        parser = backend.parser
        tools_on = bool(opts.tools) and opts.tool_choice != "none" and opts.json_schema is None
        if opts.json_schema is not None:  # the SDK's constrained decoder, as for forced calls
            events = backend.decode_json(
                opts.json_schema,
                max_tokens=opts.max_call_tokens,
                sampling=SamplingParams(temperature=opts.temperature, seed=opts.seed),
                limit_name="max_call_tokens",
            )
        else:
            names = [t["function"]["name"] for t in opts.tools]
            force = resolve_tool_choice(opts.tool_choice, names) if tools_on else None
            request = GenerateRequest(
                tools=opts.tools if tools_on else [],
                force=force,
                max_new_tokens=opts.max_tokens,
                max_call_tokens=opts.max_call_tokens,
                temperature=opts.temperature,
                seed=opts.seed,
            )
            events = backend.generate(request)
        deltas: Iterator[Any] = ((e.kind, e.text or e.finish_reason) for e in events)
        full, emitted, finish = "", 0, "length"
        stops = opts.stop if opts.json_schema is None else ()
        for kind, value in deltas:
            if kind == "done":
                finish = value or finish
                continue
            if kind == "reasoning" and value:  # a thinking model's <think> block: not the answer
                state.reasoning += value
                yield AIMessageChunk(content="", additional_kwargs={"reasoning_content": value})
                continue
            if kind != "text" or not value:
                continue
            full += value
            cut = len(full)
            if tools_on and (i := parser.call_started(full)) is not None:
                cut = i
            hit = [j for j in (full.find(s) for s in stops) if 0 <= j < cut]
            if hit:
                cut = min(hit)
            visible = cut if hit else cut - held_back_for_stops(full[:cut], stops)
            if visible > emitted:
                yield AIMessageChunk(content=full[emitted:visible])
                emitted = visible
            if hit:
                full, finish = full[:cut], "stop"
                break
        if opts.json_schema is not None:
            finish = "stop"
        call_at = parser.call_started(full) if tools_on else None
        if emitted < len(full) and call_at is None:
            yield AIMessageChunk(content=full[emitted:])
            emitted = len(full)
        if emitted < len(full) and call_at is not None:
            # text before the call that was not yet emitted
            head = full[:call_at]
            if len(head) > emitted:
                yield AIMessageChunk(content=head[emitted:])
                emitted = len(head)
        state.content = full[:emitted]
        if tools_on:
            yield from _tool_chunks(parser.parse(full, opts.tools), state)
            if state.tool_calls:
                finish = "tool_calls"
        output_tokens = max(0, backend.position - len(ids))
        state.usage = {
            "input_tokens": len(ids),
            "output_tokens": output_tokens,
            "total_tokens": len(ids) + output_tokens,
            "input_token_details": {"cache_read": cache_read},
        }
        state.response_metadata = {
            "model_name": opts.model_name,
            "model_provider": "freetoken",
            "finish_reason": finish,
        }
        yield AIMessageChunk(
            content="",
            usage_metadata=state.usage,  # type: ignore[arg-type]
            response_metadata=state.response_metadata,
            chunk_position="last",
        )
    finally:
        handle.lock.release()


def _tool_chunks(parsed: Any, state: TurnState) -> Iterator[AIMessageChunk]:
    chunks = []
    for call in parsed.calls:
        cid = _call_id()
        if call.error or not isinstance(call.arguments, dict):
            args = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
            state.invalid_tool_calls.append(
                invalid_tool_call(name=call.name or None, args=args, id=cid, error=call.error)
            )
            continue
        state.tool_calls.append(tool_call(name=call.name, args=call.arguments, id=cid))
        args = json.dumps(call.arguments, ensure_ascii=False)
        chunks.append(tool_call_chunk(name=call.name, args=args, id=cid, index=len(chunks)))
    if parsed.partial:
        state.invalid_tool_calls.append(
            invalid_tool_call(name=None, args=parsed.partial, id=_call_id(), error="unterminated tool call")
        )
    if chunks:
        yield AIMessageChunk(content="", tool_call_chunks=chunks)
    if state.invalid_tool_calls:
        yield AIMessageChunk(content="", invalid_tool_calls=state.invalid_tool_calls)
