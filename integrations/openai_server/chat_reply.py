"""A chat completion's reply on the wire: one job's events (`completion.py`) as one ChatCompletion
or as server-sent chunks, in OpenAI's exact shape (`schemas.WireModel`: `finish_reason`, `logprobs`
and `system_fingerprint` present as null where OpenAI sends null, `content: null` beside tool
calls; fields OpenAI leaves out, left out).

A stream is: a first chunk with the role, a chunk per piece of text, reasoning or tool call, a
chunk with the finish reason and an empty delta, with `stream_options.include_usage` one more
chunk with no choices and the usage (every other chunk then carries `"usage": null`), then
`data: [DONE]`. An error after the headers went out is sent as an error event, as OpenAI does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from freetoken_agents import __version__

from ..token_logprobs import TokenLogprobs
from .completion import (
    ContentDelta,
    Finished,
    ReasoningDelta,
    ToolCallDone,
    total_usage,
    wire_logprobs,
)
from .errors import OpenAIError, internal_error
from .queue import Job
from .schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    FunctionCall,
    ResponseMessage,
    ToolCallDelta,
    ToolCallOut,
    Usage,
)

logger = logging.getLogger(__name__)


def system_fingerprint(model_fingerprint: str, dtype: str, device: str) -> str:
    """What OpenAI's `system_fingerprint` stands for (with `seed`, the same reply): this server's
    version, the model's weights and tokenizer, and the dtype and device it computes in."""
    tag = f"freetoken {__version__}|{model_fingerprint}|{dtype}|{device}"
    return f"fp_{hashlib.sha256(tag.encode()).hexdigest()[:12]}"


class ChatReply:
    """Turns a job's events into one ChatCompletion (`collect`) or a stream of chunks (`stream`)."""

    def __init__(self, rid: str, model: str, request: ChatCompletionRequest, fingerprint: str) -> None:
        self.id, self.model, self.request, self.fingerprint = rid, model, request, fingerprint
        self.created = int(time.time())
        options = request.stream_options
        self.include_usage = bool(options and options.include_usage)

    async def collect(self, job: Job) -> dict[str, Any]:
        # per choice (n > 1: they come one after the other): text, reasoning, calls, logprobs
        parts: dict[int, tuple[list, list, list, list]] = {}
        done: dict[int, Finished] = {}
        async for event in job.results():
            text, reasoning, calls, logprobs = parts.setdefault(event.choice, ([], [], [], []))
            if isinstance(event, ContentDelta):
                text.append(event.text)
            elif isinstance(event, ReasoningDelta):
                reasoning.append(event.text)
            elif isinstance(event, ToolCallDone):
                call = FunctionCall(name=event.name, arguments=event.arguments)
                calls.append(ToolCallOut(id=event.id, function=call))
            else:
                done[event.choice] = event
            if not isinstance(event, ToolCallDone):
                logprobs.extend(event.logprobs)
        ends = [done[i] for i in sorted(done)]
        if not ends or done.keys() != parts.keys() or any(d.finish_reason == "cancelled" for d in ends):
            raise OpenAIError(499, "the request was cancelled", type="cancelled")
        choices = []
        for index, (text, reasoning, calls, logprobs) in sorted(parts.items()):
            # set only what the reply has: an explicit None would be sent as null (`WireModel`)
            extra: dict[str, Any] = {"tool_calls": calls} if calls else {}
            if reasoning:
                extra["reasoning_content"] = "".join(reasoning)
            message = ResponseMessage(content="".join(text) if text or not calls else None, **extra)
            lp = wire_logprobs(logprobs) if self.request.logprobs else None
            finish = done[index].finish_reason
            choices.append(Choice(index=index, message=message, logprobs=lp, finish_reason=finish))  # type: ignore[arg-type]
        completion = ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=total_usage(ends),
            system_fingerprint=self.fingerprint,
        )
        return completion.model_dump(mode="json")

    def _chunk(
        self,
        delta: Delta | None,
        finish: str | None = None,
        usage: Usage | None = None,
        *,
        index: int = 0,
        logprobs: Sequence[TokenLogprobs] = (),
    ) -> str:
        """A chunk of `delta` for choice `index` with its tokens' `logprobs`, or (None) the usage."""
        lp = wire_logprobs(logprobs) if logprobs else None
        choices = []
        if delta is not None:
            choices = [ChunkChoice(index=index, delta=delta, logprobs=lp, finish_reason=finish)]  # type: ignore[arg-type]
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=self.fingerprint,
            choices=choices,
            **({"usage": usage} if self.include_usage else {}),
        )
        return f"data: {chunk.model_dump_json()}\n\n"

    async def stream(self, job: Job) -> AsyncIterator[str]:
        opened, done = {0}, []  # choices whose role chunk went out; their ends
        yield self._chunk(Delta(role="assistant", content=""))
        try:
            async for event in job.results():
                if event.choice not in opened:  # n > 1: the next choice begins
                    opened.add(event.choice)
                    yield self._chunk(Delta(role="assistant", content=""), index=event.choice)
                if isinstance(event, ContentDelta):
                    delta = Delta(content=event.text)
                    yield self._chunk(delta, index=event.choice, logprobs=event.logprobs)
                elif isinstance(event, ReasoningDelta):
                    delta = Delta(reasoning_content=event.text)
                    yield self._chunk(delta, index=event.choice, logprobs=event.logprobs)
                elif isinstance(event, ToolCallDone):
                    call = ToolCallDelta(
                        index=event.index,
                        id=event.id,
                        type="function",
                        function={"name": event.name, "arguments": event.arguments},
                    )
                    yield self._chunk(Delta(tool_calls=[call]), index=event.choice)
                elif event.finish_reason != "cancelled":
                    end = event.finish_reason
                    yield self._chunk(Delta(), end, index=event.choice, logprobs=event.logprobs)
                    done.append(event)
            if self.include_usage and done:  # once, after every choice's end
                yield self._chunk(None, usage=total_usage(done))
        except OpenAIError as e:  # after the headers went out: an error event, as OpenAI sends
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception as e:
            logger.exception("a streamed completion failed")
            yield f"data: {json.dumps(internal_error(e).body())}\n\n"
        yield "data: [DONE]\n\n"
