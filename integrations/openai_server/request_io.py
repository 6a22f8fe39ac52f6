"""The HTTP plumbing every POST route shares (chat completions in `app.py`, the legacy
completions in `completions_api.py`, the Responses API in `responses_api.py`): the API key, the
body (under its byte limit and time limits), its JSON parsed into the route's pydantic request,
the tenant that scopes prefix reuse, a chat request checked and its grammars compiled, a job
submitted to the engine worker (429 when the queue is full) and watched for a client that leaves,
and the reply sent as one JSON body or as a stream.

The routes reach the app's state through the narrow `ServerHost` protocol, never by importing
`app.py` (`app.py` imports this module and the route modules: the package has no import circle).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, TypeVar

import anyio
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from ..prefix_cache import PrefixCache
from .errors import OpenAIError, bad_request, from_validation_error, internal_error
from .prepare import check, compile_grammars
from .queue import EngineWorker, Job, JobEnd, QueueFull
from .schemas import ChatCompletionRequest

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class HostConfig(Protocol):
    """The parts of `app.ServerConfig` these routes read."""

    model_name: str
    api_key: str | Sequence[str] | None
    prefix_cache: bool
    max_request_bytes: int
    body_idle_s: float
    body_timeout_s: float
    grammar_timeout_s: float


class ServerHost(Protocol):
    """The parts of `app.ServerState` these routes use: the backend the worker drives (a
    FreeTokenModel), its prefix cache, the worker, the config, and the chat job factory."""

    backend: Any
    cache: PrefixCache
    worker: EngineWorker
    config: HostConfig

    def job(self, checked: Any, tenant: str, loop: asyncio.AbstractEventLoop) -> Job: ...


class Reply(Protocol):
    """A route's reply: a job's events as one JSON body, or as server-sent text."""

    async def collect(self, job: Job) -> dict[str, Any]: ...

    def stream(self, job: Job) -> AsyncIterator[str]: ...


def authorize(request: Request, api_key: str | Sequence[str] | None) -> str | None:
    """The key the request carries, if it is one of `api_key`'s (401 otherwise); None when the
    server needs no key. Every key is compared in constant time."""
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


def tenant(key: str | None, user: str | None) -> str:
    """Whose prompts a request may reuse: one tenant per (API key, `user`) pair."""
    key_id = hashlib.sha256(key.encode()).hexdigest()[:16] if key is not None else "-"
    return f"{key_id}/{user or ''}"


async def read_body(request: Request, config: HostConfig) -> bytes:
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
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.body_timeout_s
    while True:
        left = deadline - loop.time()
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


async def parse_body(
    request: Request, config: HostConfig, schema: type[M], *, tags: frozenset[str] = frozenset()
) -> M:
    """The body as `schema`: a 400 for JSON that does not parse, nests too deeply, holds a lone
    surrogate or is not an object, and a 400 naming the first field `schema` refuses. `tags`: the
    tags of `schema`'s tagged unions, left out of the field's name (`input[2].content`, not
    `input[2].message.content`)."""
    raw = await read_body(request, config)
    try:
        payload = json.loads(raw)
        # a lone surrogate (\\ud800) cannot be encoded for the tokenizer: refuse it here
        json.dumps(payload, ensure_ascii=False).encode("utf-8")
    except RecursionError:  # deeply nested JSON: a client error, not a 500
        raise bad_request("the JSON body of your request is nested too deeply") from None
    except UnicodeEncodeError:
        raise bad_request("the request contains a lone UTF-16 surrogate, which is not valid text") from None
    except ValueError as e:
        raise bad_request(f"We could not parse the JSON body of your request: {e}") from None
    if not isinstance(payload, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return schema.model_validate(payload)
    except ValidationError as e:
        problems = [{**p, "loc": tuple(x for x in p["loc"] if x not in tags)} for p in e.errors()]
        raise from_validation_error(RequestValidationError(problems)) from None


async def read_request(
    request: Request, config: HostConfig, schema: type[M], *, tags: frozenset[str] = frozenset()
) -> tuple[M, str]:
    """The request's key checked first (`authorize`: 401), then its body as `schema`
    (`parse_body`); returns the body and its tenant (`tenant`: the key and the body's `user`)."""
    key = authorize(request, config.api_key)
    body = await parse_body(request, config, schema, tags=tags)
    return body, tenant(key, body.user)  # type: ignore[attr-defined]


async def start(request: Request, host: ServerHost, job: Job) -> tuple[Any, asyncio.Task]:
    """Submit `job` and wait for its first event (the worker took it and its prompt was
    prepared): returns that event and the task watching for the client to leave (the caller
    cancels it when the reply is over). OpenAIError: 429 when the queue is full, the job's own
    error when it was refused while prepared, 499 when it was cancelled before it ran."""
    try:
        host.worker.submit(job)
    except QueueFull as e:
        raise OpenAIError(
            429,
            str(e),
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(e.retry_after)},
        ) from None
    watcher = asyncio.create_task(watch_disconnect(request, job, host.worker))
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
        raise cancelled()
    return first, watcher


async def start_chat(
    request: Request, host: ServerHost, body: ChatCompletionRequest, who: str
) -> tuple[Job, asyncio.Task]:
    """`body` checked (`prepare.check`, time linear in the body) and its grammars compiled
    (`prepare.compile_grammars`: on the grammar-compile thread, never on the engine worker), then
    its chat job for tenant `who` started (`start`): the job and the task watching its client."""
    config = host.config
    checked = await anyio.to_thread.run_sync(
        lambda: compile_grammars(
            check(body, host.backend, model_name=config.model_name),
            host.backend,
            timeout=config.grammar_timeout_s,
        )
    )
    job = host.job(checked, who, asyncio.get_running_loop())
    _, watcher = await start(request, host, job)
    return job, watcher


async def respond(
    reply: Reply, job: Job, watcher: asyncio.Task, worker: EngineWorker, *, stream: bool
) -> JSONResponse | StreamingResponse:
    """`reply` as server-sent events (`stream`; the stream cancels `watcher` when it ends) or as
    one JSON body, once the job is over."""
    if stream:
        return StreamingResponse(
            _to_the_end(reply.stream(job), job, watcher, worker),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        return JSONResponse(await reply.collect(job))
    finally:
        watcher.cancel()


async def _to_the_end(
    chunks: AsyncIterator[str], job: Job, watcher: asyncio.Task, worker: EngineWorker
) -> AsyncIterator[str]:
    """`chunks`, then `watcher` cancelled; the job cancelled too when the stream did not end (the
    client left mid-stream)."""
    ended = False
    try:
        async for chunk in chunks:
            yield chunk
        ended = True
    finally:
        watcher.cancel()
        if not ended:  # the client left mid-stream
            worker.client_left(job)


async def watch_disconnect(request: Request, job: Job, worker: EngineWorker) -> None:
    """Cancel `job` when its client disconnects before the job ends."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            worker.client_left(job)
            return


def cancelled() -> OpenAIError:
    return OpenAIError(499, "the request was cancelled", type="cancelled")


def as_openai_error(error: BaseException) -> OpenAIError:
    """`error` as it goes on the wire after the headers went out (an error event in the stream)."""
    if isinstance(error, OpenAIError):
        return error
    logger.error("a streamed reply failed", exc_info=error)
    return internal_error(error)
