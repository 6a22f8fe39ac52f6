"""The HTTP side: a FastAPI app serving the OpenAI chat-completions API over one engine.

Routes: POST /v1/chat/completions (JSON or server-sent events), POST /v1/completions
(`completions_api.py`), POST /v1/responses (`responses_api.py`), GET /v1/models (the server is
ready when it answers) and /v1/models/{id}, GET /health (no key needed; the queue's counters).
Every error is an OpenAI-style body (`errors.py`); after any of them the server goes on serving.
Replies are in OpenAI's exact wire shape (`chat_reply.py`); CORS is off unless origins are named
(`cors.py`).

A request is parsed and checked (`request_io.py`, the plumbing every route shares: auth first,
then the body under its byte limit, JSON, the schema, then `prepare.check`: fields and the cost of
every JSON schema, in time linear in the body), its grammars compiled (`prepare.compile_grammars`:
on the one grammar-compile thread, with a deadline, never on the engine worker), then queued for
the engine worker (`queue.py`), which first runs `prepare.prepare` (render, tokenize, bound the
prompt, one request at a time) and then `completion.run_completion`. A client that disconnects
cancels its job, waiting, being prepared or running. A 400 found while preparing is answered before
any byte of the response is sent.
"""

from __future__ import annotations

import asyncio
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
from starlette.exceptions import HTTPException as StarletteHTTPException

from freetoken_agents.sync_bridge import step_worker

from ..prefix_cache import PrefixCache
from .chat_reply import ChatReply, system_fingerprint
from .completion import run_completion
from .completions_api import add_completion_routes
from .cors import add_cors, check_origin
from .errors import OpenAIError, from_validation_error, internal_error, model_not_found
from .prepare import COMPILE_TIMEOUT_S, CheckedRequest, prepare
from .queue import EngineWorker, Job
from .request_io import authorize, read_request, respond, start_chat
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
        authorize(request, config.api_key)
        return ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")  # path: a served Hub id holds a slash (org/name)
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        authorize(request, config.api_key)
        if model_id != config.model_name:
            raise model_not_found(model_id, config.model_name)
        return model_card().model_dump()

    def model_card() -> ModelCard:
        return ModelCard(id=config.model_name, created=state.created, max_model_len=engine.max_context)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
        body, who = await read_request(request, config, ChatCompletionRequest)
        job, watcher = await start_chat(request, state, body, who)
        reply = ChatReply(completion_id(), config.model_name, body, state.fingerprint)
        return await respond(reply, job, watcher, state.worker, stream=body.stream)

    add_completion_routes(app, state)  # POST /v1/completions (completions_api.py)
    add_response_routes(app, state)  # POST /v1/responses (responses_api.py)
    return app


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
