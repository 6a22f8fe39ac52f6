"""The HTTP side: a FastAPI app serving the OpenAI chat-completions API over one engine.

Routes: POST /v1/chat/completions (JSON or server-sent events), POST /v1/completions
(`completions_api.py`), POST /v1/responses (`responses_api.py`), GET /v1/models (the server is
ready when it answers) and /v1/models/{id}, GET /health (no key needed; the queue's counters).
Every error is an OpenAI-style body (`errors.py`); after any of them the server goes on serving.
Replies are in OpenAI's exact wire shape (`chat_reply.py`); CORS is off unless origins are named
(`cors.py`).

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
from .chat_reply import ChatReply, system_fingerprint
from .completion import run_completion
from .completions_api import add_completion_routes
from .cors import add_cors, check_origin
from .errors import OpenAIError, bad_request, from_validation_error, internal_error, model_not_found
from .prepare import COMPILE_TIMEOUT_S, CheckedRequest, check, compile_grammars, prepare
from .queue import EngineWorker, Job, JobEnd, QueueFull
from .responses_api import add_response_routes
from .schemas import ChatCompletionRequest, ModelCard, ModelList, completion_id

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
    the grammar-compile thread (503 past it) and each compile at most that long (400 past it);
    cors_origins: browser origins (`https://app.example`, or `*`) allowed to call the server
    (`cors.py`; none: no CORS, a browser app's preflight is refused).

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
    cors_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for origin in self.cors_origins:
            check_origin(origin)  # InvalidOrigin before the server starts, not a silent mismatch


class _Started:
    """The worker took the job: a stream may send its headers and first chunk."""


class ServerState:
    """What the app holds: the backend the worker drives, its prefix cache, the worker."""

    def __init__(self, backend: FreeTokenModel, config: ServerConfig) -> None:
        self.backend, self.config = backend, config
        self.cache = PrefixCache(max_entries=config.cached_prefixes)
        self.worker = EngineWorker(step_worker(backend.step_owner), config.max_queue)
        self.created = int(time.time())
        engine = backend.engine
        self.fingerprint = system_fingerprint(engine.model_fingerprint, str(engine.dtype), engine.device.type)
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
    if config.cors_origins:
        add_cors(app, config.cors_origins)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": config.model_name, "queue": state.worker.stats()}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _authorize(request, config.api_key)
        return ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")  # path: a served Hub id holds a slash (org/name)
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        _authorize(request, config.api_key)
        if model_id != config.model_name:
            raise model_not_found(model_id, config.model_name)
        return model_card().model_dump()

    def model_card() -> ModelCard:
        return ModelCard(id=config.model_name, created=state.created, max_model_len=engine.max_context)

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
        reply = ChatReply(completion_id(), config.model_name, body, state.fingerprint)
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

    add_completion_routes(app, state)  # POST /v1/completions (completions_api.py)
    add_response_routes(app, state)  # POST /v1/responses (responses_api.py)
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
        return internal_error(exc).response()
