"""POST /v1/responses: the Responses API's text and function-calling subset, as the
openai-agents SDK and newer OpenAI SDKs call it.

A request is turned into the chat-completions request it means (`responses_input.chat_request`)
and then runs exactly as one: `prepare.check` and `prepare.compile_grammars` on the HTTP side, the
server's chat job on the engine worker (prompt preparation, then `completion.run_completion`: the
shared chat turn, function calls decoded under their schema's grammar, forced ones included). The
turn's events become output items (`responses_output.OutputBuilder`): one `response` object, or
the semantic server-sent events (`event: <type>` and `data: <json>`, each with a
`sequence_number`) from response.created to response.completed (response.incomplete when
max_output_tokens cut the reply). Errors name the Responses request's fields
(`ParamNames.rename`). Nothing is stored (`store` is false).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .completion import Finished
from .errors import OpenAIError
from .queue import Job
from .request_io import ServerHost, as_openai_error, cancelled, read_request, respond, start_chat
from .responses_input import ParamNames, chat_request, refuse_unsupported
from .responses_output import OutputBuilder
from .responses_schemas import (
    ITEM_TYPES,
    InputTokensDetails,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    new_id,
)

__all__ = ["add_response_routes"]


def add_response_routes(app: FastAPI, host: ServerHost) -> None:
    """Register POST /v1/responses on `app`, served by `host`'s worker and backend."""
    config = host.config

    @app.post("/v1/responses", response_model=None)
    async def responses(request: Request) -> JSONResponse | StreamingResponse:
        body, who = await read_request(request, config, ResponsesRequest, tags=ITEM_TYPES)
        refuse_unsupported(body)
        chat, names = chat_request(body)
        try:
            job, watcher = await start_chat(request, host, chat, who)
        except OpenAIError as e:
            raise names.rename(e) from None
        reply = _Reply(body, config.model_name, names)
        return await respond(reply, job, watcher, host.worker, stream=body.stream)


class _Reply:
    """Turns a chat job's events into one `response` object or its stream of events."""

    def __init__(self, body: ResponsesRequest, model: str, names: ParamNames) -> None:
        self.body, self.model, self.names = body, model, names
        self.id, self.created = new_id("resp"), int(time.time())
        self.builder = OutputBuilder()

    def response(self, status: str, *, error: OpenAIError | None = None) -> dict[str, Any]:
        body, done = self.body, self.builder.finished
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        choice = body.tool_choice
        usage = None
        if done is not None and status != "failed":
            usage = ResponseUsage(
                input_tokens=done.prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=done.cached_tokens),
                output_tokens=done.completion_tokens,
                total_tokens=done.prompt_tokens + done.completion_tokens,
            )
        response = ResponseObject(
            id=self.id,
            created_at=self.created,
            status=status,  # type: ignore[arg-type]
            completed_at=int(time.time()) if status in ("completed", "incomplete") else None,
            model=self.model,
            output=[dict(item) for item in self.builder.output] if status != "in_progress" else [],
            instructions=body.instructions,
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
            tool_choice=choice.model_dump()
            if choice is not None and not isinstance(choice, str)
            else choice or "auto",
            parallel_tool_calls=body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            temperature=body.temperature if body.temperature is not None else 1.0,
            top_p=body.top_p if body.top_p is not None else 1.0,
            max_output_tokens=body.max_output_tokens,
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            metadata=body.metadata or {},
            usage=usage,
            error=ResponseError(code=error.code or error.type, message=error.message) if error else None,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,  # type: ignore[arg-type]
        )
        return response.model_dump(mode="json")

    async def collect(self, job: Job) -> dict[str, Any]:
        try:
            async for event in job.results():
                self.builder.feed(event)
        except OpenAIError as e:
            raise self.names.rename(e) from None
        done = self.builder.finished
        if done is None or done.finish_reason == "cancelled":
            raise cancelled()
        return self.response("incomplete" if self.builder.incomplete else "completed")

    async def stream(self, job: Job) -> AsyncIterator[str]:
        sequence = 0

        def sse(event: dict[str, Any]) -> str:
            nonlocal sequence
            event["sequence_number"] = sequence
            sequence += 1
            return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

        yield sse({"type": "response.created", "response": self.response("in_progress")})
        yield sse({"type": "response.in_progress", "response": self.response("in_progress")})
        try:
            async for event in job.results():
                if isinstance(event, Finished) and event.finish_reason == "cancelled":
                    break  # the client left: nobody reads the rest
                for out in self.builder.feed(event):
                    yield sse(out)
            if self.builder.finished is not None and self.builder.finished.finish_reason != "cancelled":
                status = "incomplete" if self.builder.incomplete else "completed"
                yield sse({"type": f"response.{status}", "response": self.response(status)})
        except Exception as e:  # after the headers went out: an error event, then response.failed
            error = self.names.rename(as_openai_error(e))
            code = error.code or error.type
            yield sse({"type": "error", "code": code, "message": error.message, "param": error.param})
            yield sse({"type": "response.failed", "response": self.response("failed", error=error)})
