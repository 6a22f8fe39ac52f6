"""One assistant turn for LangChain: the shared chat turn (`integrations.chat_turn`: prefix reuse,
generation, stop strings, tool-call parsing) as `AIMessageChunk`s.

`run_turn` is a plain generator of `AIMessageChunk`s: content deltas as they are decoded, then
one chunk with the tool calls (`tool_call_chunks`, each with an index) or `invalid_tool_calls`,
then a last chunk (`chunk_position="last"`) carrying `usage_metadata` and `response_metadata`.
Every `next()` runs at most one engine step (a decode, or one forced stretch); ChatFreeToken runs
each on the engine's step worker (`sync_bridge.iterate_on`), so concurrent calls interleave their
steps there. Each call has a context of its own over the engine (`EngineHandle.open_context`: the
one the last call left, whose session still holds its prompt and reply, or a new one), given back
when the turn ends: no lock is held between steps, concurrent calls never share a context, and the
prefix cache (engine anchors) carries what one call leaves to another.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import AIMessageChunk
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk

from freetoken_agents.constrained import resolve_tool_choice

from ..chat_turn import (
    ChatTurnRequest,
    ContentDelta,
    Finished,
    ReasoningDelta,
    ToolCallDone,
    no_calls,
    run_chat_turn,
)
from .engines import EngineHandle

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnOptions:
    """Per-call settings. force_choice: 'auto' | 'none' | 'required' | a tool name; json_schema:
    constrain the whole turn to this JSON schema (structured output); argument_sources: ground
    tool-call string arguments in these texts (None: the grammar alone); call_sources: call only
    tools these texts are about (None: any offered tool)."""

    model_name: str
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"
    json_schema: dict[str, Any] | None = None
    stop: tuple[str, ...] = ()
    max_tokens: int = 256
    max_call_tokens: int = 192
    temperature: float = 0.0
    seed: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # ChatTurnRequest's sampling fields
    reuse: bool = True
    argument_sources: tuple[str, ...] | None = None
    call_sources: tuple[str, ...] | None = None


@dataclass
class TurnState:
    """What a finished turn produced (for `_generate`, which builds one AIMessage)."""

    content: str = ""
    reasoning: str = ""  # a thinking model's <think> block (additional_kwargs["reasoning_content"])
    tool_calls: list[dict] = field(default_factory=list)
    invalid_tool_calls: list[dict] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    response_metadata: dict[str, Any] = field(default_factory=dict)


def run_turn(
    handle: EngineHandle, ids: list[int], opts: TurnOptions, state: TurnState | None = None
) -> Generator[AIMessageChunk, None, None]:
    """Generate one assistant turn after prompt `ids` (see the module docstring)."""
    state = state if state is not None else TurnState()
    tools_on = bool(opts.tools) and opts.tool_choice != "none" and opts.json_schema is None
    names = [t["function"]["name"] for t in opts.tools]
    calls: dict[str, Any] = {"tools": opts.tools if tools_on else [], "call_sources": opts.call_sources}
    if opts.tools and opts.tool_choice == "none" and opts.json_schema is None:
        calls = no_calls(handle.backend, {})  # the prompt shows the tools; no call may start
    request = ChatTurnRequest(
        ids=ids,
        force=resolve_tool_choice(opts.tool_choice, names) if tools_on else None,
        json_schema=opts.json_schema,
        stop=tuple(opts.stop),
        max_tokens=opts.max_tokens,
        max_call_tokens=opts.max_call_tokens,
        json_limit="max_call_tokens",  # the SDK's constrained decoder, as for forced calls
        temperature=opts.temperature,
        seed=opts.seed,
        **opts.sampling,
        argument_sources=opts.argument_sources,
        **calls,
    )
    context, ok = handle.open_context(), False
    # No reply pinned: the context given back keeps it live for the conversation's next call.
    turn = run_chat_turn(context, handle.cache, request, reuse=opts.reuse, record=False)
    try:
        chunks: list[Any] = []
        done: Finished | None = None
        for event in turn:
            if isinstance(event, ContentDelta):
                if not event.after_calls:  # the message's content is the text before its calls
                    state.content += event.text
                    yield AIMessageChunk(content=event.text)
            elif isinstance(event, ReasoningDelta):  # a thinking model's <think> block: not the answer
                state.reasoning += event.text
                yield AIMessageChunk(content="", additional_kwargs={"reasoning_content": event.text})
            elif isinstance(event, ToolCallDone):
                if event.error is not None:
                    state.invalid_tool_calls.append(
                        invalid_tool_call(
                            name=event.name or None, args=event.arguments, id=event.id, error=event.error
                        )
                    )
                    continue
                state.tool_calls.append(tool_call(name=event.name, args=event.args, id=event.id))
                chunks.append(
                    tool_call_chunk(name=event.name, args=event.arguments, id=event.id, index=len(chunks))
                )
            else:
                done = event
        assert done is not None
        if chunks:
            yield AIMessageChunk(content="", tool_call_chunks=chunks)
        if state.invalid_tool_calls:
            yield AIMessageChunk(content="", invalid_tool_calls=state.invalid_tool_calls)
        state.usage = {
            "input_tokens": done.prompt_tokens,
            "output_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "input_token_details": {"cache_read": done.cached_tokens},
        }
        state.response_metadata = {
            "model_name": opts.model_name,
            "model_provider": "freetoken",
            "finish_reason": _finish_reason(done, opts),
        }
        yield AIMessageChunk(
            content="",
            usage_metadata=state.usage,  # type: ignore[arg-type]
            response_metadata=state.response_metadata,
            chunk_position="last",
        )
        ok = True
    except GeneratorExit:  # the consumer stopped early: the context is sound, the turn cut short
        ok = True
        raise
    finally:
        turn.close()  # the decoder lets go of the context first
        handle.release_context(context, keep=ok)  # a failed turn's context is closed, not reused


def _finish_reason(done: Finished, opts: TurnOptions) -> str:
    """LangChain's finish_reason: the decoder's own when the reply was cut short ("memory" too),
    "stop" for a structured reply, "tool_calls" when the turn called tools."""
    if done.finish_reason == "tool_calls":
        return "tool_calls"
    if opts.json_schema is not None:
        return "stop"
    if done.finish_reason == "length" and done.backend_reason:
        return done.backend_reason
    return done.finish_reason
