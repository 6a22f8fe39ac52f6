"""The HTTP plumbing the legacy completions and the Responses routes share: the API key, the
body (under its byte limit and time limits), its JSON parsed into the route's pydantic request,
the tenant that scopes prefix reuse, a job submitted to the engine worker (429 when the queue is
full) and watched for a client that leaves.

These routes are registered by `app.create_app`; they reach the app's state through the narrow
`ServerHost` protocol, never by importing `app.py` (the package has no import circle).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from ..prefix_cache import PrefixCache
from .errors import OpenAIError, bad_request, from_validation_error, internal_error
from .queue import EngineWorker, Job, JobEnd, QueueFull

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


def authorize(request: Request, api_key: str | Sequence[str] | None) -> str | None:
    """The key the request carries, if it is one of `api_key`'s (401 otherwise); None when the
    server needs no key. Every key is compared in constant time."""
    if api_key is None:
        return None
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key)
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    sent = token.strip().encode()
    matched = [key for key in keys if hmac.compare_digest(sent, key.encode())]
    if scheme.lower() != "bearer" or not matched:
        raise OpenAIError(
            401,
            "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
            code="invalid_api_key",
        )
    return matched[0]


def tenant(key: str | None, user: str | None) -> str:
    """Whose prompts a request may reuse: one tenant per (API key, `user`) pair, as for chat."""
    key_id = hashlib.sha256(key.encode()).hexdigest()[:16] if key is not None else "-"
    return f"{key_id}/{user or ''}"


async def read_body(request: Request, config: HostConfig) -> bytes:
    """The body, refused with a 413 as soon as it (or its declared Content-Length) passes the
    limit, and with a 408 when no byte came for `body_idle_s` or it was not whole after
    `body_timeout_s` (uvicorn has no read timeout of its own)."""
    limit = config.max_request_bytes
    too_large = OpenAIError(
        413,
        f"the request body is larger than the server's limit of {limit} bytes",
        code="request_too_large",
        headers={"Connection": "close"},
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
                headers={"Connection": "close"},
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
        json.dumps(payload, ensure_ascii=False).encode("utf-8")  # a lone surrogate: not text
    except RecursionError:
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
    if isinstance(first, JobEnd):
        watcher.cancel()
        if first.error is not None:
            raise first.error
        raise cancelled()
    return first, watcher


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
