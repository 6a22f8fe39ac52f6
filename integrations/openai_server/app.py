"""The HTTP side: a FastAPI app serving the OpenAI chat-completions API over one engine.

Routes: POST /v1/chat/completions (JSON or server-sent events), GET /v1/models (the server is
ready when it answers), GET /health (no key needed; the queue's counters). Every error is an
OpenAI-style body (`errors.py`); after any of them the server goes on serving.

A request is parsed and checked here (auth first, then the body under its byte limit, JSON, the
schema, then `prepare.check`: fields and the cost of every JSON schema, in time linear in the
body), its grammars compiled (`prepare.compile_grammars`: on the one grammar-compile thread, with
a deadline, never on the engine worker), then queued for the engine worker (`queue.py`), which
first runs `prepare.prepare` (render, tokenize, bound the prompt, one request at a time) and then
`completion.run_completion`. A client that disconnects cancels its job, waiting, being prepared or
running. A 400 found while preparing is answered before any byte of the response is sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Generator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from freetoken_agents.sync_bridge import step_worker

from ..prefix_cache import PrefixCache
from .completion import ContentDelta, Event, Finished, ReasoningDelta, ToolCallDone, run_completion
from .errors import OpenAIError, bad_request, from_validation_error
from .prepare import COMPILE_TIMEOUT_S, CheckedRequest, check, compile_grammars, prepare
from .queue import EngineWorker, Job, JobEnd, QueueFull
from .schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    FunctionCall,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ResponseMessage,
    ToolCallDelta,
    ToolCallOut,
    Usage,
    completion_id,
)

if TYPE_CHECKING:
    from freetoken_agents.engine import Engine
    from freetoken_agents.model import FreeTokenModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """model_name: the id clients pass as `model` (and /v1/models lists); api_key: when set (one
    key or several), /v1 requests need `Authorization: Bearer <key>`; max_queue: requests that may
    wait behind the running one; prefix_cache: reuse the KV of earlier prompts (False: prefill every prompt);
    cached_prefixes: prompts (and replies) kept pinned for reuse; max_request_bytes: the largest
    body accepted (413 past it, counted while reading so a huge body is never buffered);
    body_idle_s / body_timeout_s: a body with no byte for that long, or not whole in that time, is a
    408 (its connection closed); grammar_timeout_s: a request's schemas wait at most that long for
    the grammar-compile thread (503 past it) and each compile at most that long (400 past it).

    Prefix reuse (and `cached_tokens`) is scoped per tenant: the API key a request used and its
    `user` field. A request never reuses KV another tenant's prompt left (pinned or live), so
    neither its cost nor `cached_tokens` tells one tenant anything about another's prompts."""

    model_name: str
    api_key: str | Sequence[str] | None = None
    max_queue: int = 16
    prefix_cache: bool = True
    cached_prefixes: int = 32
    max_request_bytes: int = 4 * 1024 * 1024
    body_idle_s: float = 10.0
    body_timeout_s: float = 60.0
    grammar_timeout_s: float = COMPILE_TIMEOUT_S


class _Started:
    """The worker took the job: a stream may send its headers and first chunk."""


class ServerState:
    """What the app holds: the backend the worker drives, its prefix cache, the worker."""

    def __init__(self, backend: FreeTokenModel, config: ServerConfig) -> None:
        self.backend, self.config = backend, config
        self.cache = PrefixCache(max_entries=config.cached_prefixes)
        self.worker = EngineWorker(step_worker(backend.step_owner), config.max_queue)
        self.created = int(time.time())
        backend.grammars()  # build the grammar compiler once, before requests validate schemas

    def job(self, checked: CheckedRequest, tenant: str, loop: asyncio.AbstractEventLoop) -> Job:
        def run(job: Job) -> Generator[Any, None, None]:
            # rendering and tokenizing cost time: here, one request at a time, and not for a
            # client that already left (its grammars were compiled before it queued)
            prepared = prepare(checked, self.backend, cancelled=lambda: job.cancelled)
            if prepared is None:
                return
            yield _Started()
            yield from run_completion(
                self.backend,
                self.cache,
                prepared,
                reuse=self.config.prefix_cache,
                cancelled=lambda: job.cancelled,
                tenant=tenant,
            )

        return Job(run, loop)


def create_app(engine: Engine, config: ServerConfig, *, family: str | None = None) -> FastAPI:
    """The server app over `engine` (one FreeTokenModel session, batch 1). `family`: the tool-call
    format, when the chat template does not tell."""
    from freetoken_agents.model import FreeTokenModel

    state = ServerState(FreeTokenModel(engine, family=family, max_anchors=8), config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.worker.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(state.worker.stop)

    app = FastAPI(title="FreeToken", summary="OpenAI-compatible chat completions", lifespan=lifespan)
    app.state.server = state
    _error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": config.model_name, "queue": state.worker.stats()}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _authorize(request, config.api_key)
        card = ModelCard(id=config.model_name, created=state.created, max_model_len=engine.max_context)
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
        key = _authorize(request, config.api_key)
        body = await _parse(request, config)
        checked = await anyio.to_thread.run_sync(
            lambda: compile_grammars(
                check(body, state.backend, model_name=config.model_name),
                state.backend,
                timeout=config.grammar_timeout_s,
            )
        )
        job = state.job(checked, _tenant(key, body.user), asyncio.get_running_loop())
        try:
            state.worker.submit(job)
        except QueueFull as e:
            raise OpenAIError(
                429,
                str(e),
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(e.retry_after)},
            ) from None
        watcher = asyncio.create_task(_watch_disconnect(request, job, state.worker))
        try:
            first = await job.events.get()
        except BaseException:
            watcher.cancel()
            job.cancel()
            raise
        if isinstance(first, JobEnd):  # refused while prepared (a 400), or cancelled before it ran
            watcher.cancel()
            if first.error is not None:
                raise first.error  # OpenAIError: its status; anything else: the 500 handler
            raise OpenAIError(499, "the request was cancelled", type="cancelled")
        reply = _Reply(completion_id(), config.model_name, body)
        if body.stream:
            return StreamingResponse(
                reply.stream(job, watcher, state.worker),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            return JSONResponse(await reply.collect(job))
        finally:
            watcher.cancel()

    return app


def _authorize(request: Request, api_key: str | Sequence[str] | None) -> str | None:
    """The key the request carries, if it is one of `api_key`'s (401 otherwise); None when the
    server needs no key."""
    if api_key is None:
        return None
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key)
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    sent = token.strip().encode()
    matched = [key for key in keys if hmac.compare_digest(sent, key.encode())]  # every key compared
    if scheme.lower() != "bearer" or not matched:
        raise OpenAIError(
            401,
            "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
            code="invalid_api_key",
        )
    return matched[0]


def _tenant(key: str | None, user: str | None) -> str:
    """Whose prompts a request may reuse: one tenant per (API key, `user`) pair."""
    key_id = hashlib.sha256(key.encode()).hexdigest()[:16] if key is not None else "-"
    return f"{key_id}/{user or ''}"


async def _read_body(request: Request, config: ServerConfig) -> bytes:
    """The body, refused with a 413 as soon as it (or its declared Content-Length) passes the
    limit, and with a 408 when it stalls: no byte for `body_idle_s`, or not whole after
    `body_timeout_s` (uvicorn has no read timeout: a client that sends its head and then stops would
    hold its connection and handler forever, and enough of them every slot)."""
    limit = config.max_request_bytes
    too_large = OpenAIError(
        413,
        f"the request body is larger than the server's limit of {limit} bytes",
        code="request_too_large",
        headers={"Connection": "close"},  # the rest of the body is never read
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    deadline = asyncio.get_running_loop().time() + config.body_timeout_s
    while True:
        left = deadline - asyncio.get_running_loop().time()
        try:
            chunk = await asyncio.wait_for(anext(stream), min(config.body_idle_s, max(left, 0.0)))
        except StopAsyncIteration:
            return b"".join(chunks)
        except TimeoutError:
            raise OpenAIError(
                408,
                f"the request body did not arrive in time ({size} bytes read; the server waits "
                f"{config.body_idle_s:g} s for each part and {config.body_timeout_s:g} s in all)",
                code="request_timeout",
                headers={"Connection": "close"},  # the rest of the body is never read
            ) from None
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)


async def _parse(request: Request, config: ServerConfig) -> ChatCompletionRequest:
    raw = await _read_body(request, config)
    try:
        payload = json.loads(raw)
    except RecursionError:  # deeply nested JSON: a client error, not a 500
        raise bad_request("the JSON body of your request is nested too deeply") from None
    except ValueError as e:
        raise bad_request(f"We could not parse the JSON body of your request: {e}") from None
    try:  # a lone surrogate (\\ud800) cannot be encoded for the tokenizer: refuse it here
        json.dumps(payload, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("the request contains a lone UTF-16 surrogate, which is not valid text") from None
    except RecursionError:
        raise bad_request("the JSON body of your request is nested too deeply") from None
    if not isinstance(payload, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return ChatCompletionRequest.model_validate(payload)
    except ValidationError as e:
        raise from_validation_error(RequestValidationError(e.errors())) from None


async def _watch_disconnect(request: Request, job: Job, worker: EngineWorker) -> None:
    """Cancel `job` when its client disconnects before the job ends."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            worker.client_left(job)
            return


def _usage(done: Finished) -> Usage:
    return Usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        total_tokens=done.prompt_tokens + done.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=done.cached_tokens),
    )


class _Reply:
    """Turns a job's events into one ChatCompletion or a stream of chunks."""

    def __init__(self, rid: str, model: str, request: ChatCompletionRequest) -> None:
        self.id, self.model, self.request = rid, model, request
        self.created = int(time.time())

    async def _events(self, job: Job) -> AsyncIterator[Event]:
        while not isinstance(event := await job.events.get(), JobEnd):
            yield event
        if event.error is not None:
            raise event.error

    async def collect(self, job: Job) -> dict[str, Any]:
        text, reasoning, calls, done = [], [], [], None
        async for event in self._events(job):
            if isinstance(event, ContentDelta):
                text.append(event.text)
            elif isinstance(event, ReasoningDelta):
                reasoning.append(event.text)
            elif isinstance(event, ToolCallDone):
                calls.append(
                    ToolCallOut(
                        id=event.id, function=FunctionCall(name=event.name, arguments=event.arguments)
                    )
                )
            else:
                done = event
        if done is None or done.finish_reason == "cancelled":
            raise OpenAIError(499, "the request was cancelled", type="cancelled")
        message = ResponseMessage(
            content="".join(text) if text or not calls else None,
            reasoning_content="".join(reasoning) or None,
            tool_calls=calls or None,
        )
        choice = Choice(message=message, finish_reason=done.finish_reason)  # type: ignore[arg-type]
        completion = ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=_usage(done)
        )
        return completion.model_dump(exclude_none=True)

    def _chunk(self, delta: Delta, finish: str | None = None, usage: Usage | None = None) -> str:
        choices = [] if usage is not None else [ChunkChoice(delta=delta, finish_reason=finish)]  # type: ignore[arg-type]
        chunk = ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )
        return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"

    async def stream(self, job: Job, watcher: asyncio.Task, worker: EngineWorker) -> AsyncIterator[str]:
        include_usage = bool(self.request.stream_options and self.request.stream_options.include_usage)
        ended = False
        try:
            yield self._chunk(Delta(role="assistant", content=""))
            try:
                async for event in self._events(job):
                    if isinstance(event, ContentDelta):
                        yield self._chunk(Delta(content=event.text))
                    elif isinstance(event, ReasoningDelta):
                        yield self._chunk(Delta(reasoning_content=event.text))
                    elif isinstance(event, ToolCallDone):
                        call = ToolCallDelta(
                            index=event.index,
                            id=event.id,
                            type="function",
                            function={"name": event.name, "arguments": event.arguments},
                        )
                        yield self._chunk(Delta(tool_calls=[call]))
                    elif event.finish_reason != "cancelled":
                        yield self._chunk(Delta(), event.finish_reason)
                        if include_usage:
                            yield self._chunk(Delta(), usage=_usage(event))
            except OpenAIError as e:  # after the headers went out: an error event, as OpenAI sends
                yield f"data: {json.dumps(e.body())}\n\n"
            except Exception as e:
                logger.exception("a streamed completion failed")
                yield f"data: {json.dumps(_internal(e).body())}\n\n"
            yield "data: [DONE]\n\n"
            ended = True
        finally:
            watcher.cancel()
            if not ended:  # the client left mid-stream
                worker.client_left(job)


def _internal(error: BaseException) -> OpenAIError:
    return OpenAIError(500, f"internal error: {type(error).__name__}: {error}", type="server_error")


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return OpenAIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("request failed")
        return _internal(exc).response()
