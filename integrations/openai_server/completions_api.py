"""POST /v1/completions: the legacy completions API, as code-completion plugins call it.

The prompt is raw text (no chat template), tokenized as untrusted text (a special token's text in
it stays text) behind the tokenizer's own leading special tokens (a BOS where the model has one),
or token ids as given. The request goes through the same queue, limits, prefix cache and errors as
chat completions: checked here (time linear in the body), tokenized on the engine worker inside
the bounded queue, decoded by `completions_decode.run_raw_completion`, answered as one
`text_completion` or as server-sent chunks of it ending with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from freetoken_agents.engine import encode_plain

from .completion import total_usage
from .completions_decode import RawRequest, TextPiece, run_raw_completion
from .completions_schemas import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionUsage,
    completion_id,
)
from .errors import OpenAIError, bad_request, model_not_found
from .prepare import _logit_bias
from .prompt_bound import bound_prompt
from .queue import Job
from .request_io import ServerHost, as_openai_error, cancelled, read_request, respond, start

__all__ = ["add_completion_routes"]


def add_completion_routes(app: FastAPI, host: ServerHost) -> None:
    """Register POST /v1/completions on `app`, served by `host`'s worker and backend."""
    config = host.config

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        body, who = await read_request(request, config, CompletionRequest)
        check(body, model_name=config.model_name)
        job = _job(host, body, who, asyncio.get_running_loop())
        started, watcher = await start(request, host, job)
        reply = _Reply(body, config.model_name, started.prompt)
        return await respond(reply, job, watcher, host.worker, stream=body.stream)


def check(body: CompletionRequest, *, model_name: str) -> None:
    """What a completion request can get wrong before its prompt is tokenized; OpenAIError if bad."""
    if body.model != model_name:
        raise model_not_found(body.model, model_name)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) and len(prompt) != 1:
        raise bad_request(
            f"prompt: {len(prompt)} prompts in one request are not supported; send one prompt per request",
            param="prompt",
        )
    if isinstance(prompt, list) and not prompt:
        raise bad_request("prompt: empty list", param="prompt")
    for name in ("n", "best_of"):
        if getattr(body, name) not in (None, 1):
            raise bad_request(
                f"{name}={getattr(body, name)} is not supported: one choice per request", param=name
            )
    if body.suffix:
        raise bad_request("suffix (insertion after the completion) is not supported", param="suffix")
    if body.echo and body.logprobs is not None:
        raise bad_request(
            "echo with logprobs is not supported: the prompt's tokens get no log-probabilities", param="echo"
        )
    if len(body.stop_strings) > 4:
        raise bad_request("at most 4 stop sequences", param="stop")


@dataclass(frozen=True)
class _Prepared:
    """The worker's first event: the prompt was tokenized and fits. `prompt`: its text (echo)."""

    prompt: str


def _job(host: ServerHost, body: CompletionRequest, who: str, loop: asyncio.AbstractEventLoop) -> Job:
    backend = host.backend

    def run(job: Job) -> Generator[Any, None, None]:
        # tokenizing costs time: here, one request at a time, and not for a client that left
        ids, prompt = _prompt_ids(body, backend, lambda: job.cancelled)
        if ids is None:
            return
        yield _Prepared(prompt)
        yield from run_raw_completion(
            backend,
            host.cache,
            RawRequest(
                ids=ids,
                max_tokens=body.max_tokens if body.max_tokens is not None else 16,
                temperature=body.temperature if body.temperature is not None else 1.0,
                top_p=body.top_p,
                seed=body.seed,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                stop=body.stop_strings,
                logit_bias=_logit_bias(body.logit_bias, backend.vocab_size),
                logprobs=body.logprobs,
            ),
            reuse=host.config.prefix_cache,
            cancelled=lambda: job.cancelled,
            tenant=who,
        )

    return Job(run, loop)


@dataclass(frozen=True)
class _PromptOnly:
    """A prompt as `prompt_bound.bound_prompt` reads a chat request: its texts and no tools."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)


def _prompt_ids(body: CompletionRequest, backend: Any, stop: Any) -> tuple[list[int] | None, str]:
    """The prompt's token ids and text; (None, "") when the client left. 400 naming `prompt` for
    ids outside the vocabulary, an empty prompt or one over the context, and naming `max_tokens`
    when the prompt and the completion together pass the context."""
    limit, prompt = backend.max_context, body.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:  # a prompt far over the context is refused before it is tokenized whole
            if not bound_prompt(_PromptOnly([{"content": prompt}]), backend, limit, stop):  # type: ignore[arg-type]
                return None, ""
        except OpenAIError as e:
            raise bad_request(e.message.replace("your messages", "your prompt"), "prompt", e.code) from None
        ids = _leading_specials(backend.tokenizer) + encode_plain(backend.tokenizer, prompt)
        text = prompt
    else:
        bad = next((t for t in prompt if not 0 <= t < backend.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"prompt: token id {bad} is outside the vocabulary [0, {backend.vocab_size})", param="prompt"
            )
        ids, text = list(prompt), backend.tokenizer.decode(prompt)
    if not ids:
        raise bad_request("prompt: the prompt holds no token", param="prompt")
    if len(ids) + 1 > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your prompt resulted "
            f"in {len(ids)} tokens. Please reduce the length of the prompt.",
            param="prompt",
            code="context_length_exceeded",
        )
    requested = body.max_tokens if body.max_tokens is not None else 16
    if len(ids) + requested > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(ids) + requested} tokens ({len(ids)} in the prompt, {requested} in the completion). "
            "Please reduce the length of the prompt or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return ids, text


# per tokenizer object, forgotten with it
_LEADING: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()


def _leading_specials(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts before a text of its own accord (a BOS; none for most BPE
    tokenizers), found by encoding one letter with and without them."""
    if tokenizer not in _LEADING:
        with_specials = tokenizer.encode("a")
        plain = tokenizer.encode("a", add_special_tokens=False)
        at = next((i for i in range(len(with_specials)) if with_specials[i : i + len(plain)] == plain), 0)
        _LEADING[tokenizer] = list(with_specials[:at])
    return list(_LEADING[tokenizer])


class _Reply:
    """Turns a job's events into one `text_completion` or a stream of chunks of it."""

    def __init__(self, body: CompletionRequest, model: str, prompt: str) -> None:
        self.body, self.model = body, model
        self.id, self.created = completion_id(), int(time.time())
        self.echo = prompt if body.echo else ""

    def _logprobs(self, pieces: list[TextPiece]) -> CompletionLogprobs | None:
        if self.body.logprobs is None:
            return None
        tokens = [t for piece in pieces for t in piece.tokens]
        return CompletionLogprobs(
            tokens=[t.token for t in tokens],
            token_logprobs=[t.logprob for t in tokens],
            top_logprobs=[t.top for t in tokens],
            text_offset=[len(self.echo) + t.offset for t in tokens],
        )

    def _completion(
        self, choices: list[CompletionChoice], usage: CompletionUsage | None = None
    ) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    async def collect(self, job: Job) -> dict[str, Any]:
        pieces, done = [], None
        async for event in job.results():
            if isinstance(event, TextPiece):
                pieces.append(event)
            else:
                done = event
        if done is None or done.finish_reason == "cancelled":
            raise cancelled()
        text = self.echo + "".join(p.text for p in pieces)
        choice = CompletionChoice(
            text=text, logprobs=self._logprobs(pieces), finish_reason=done.finish_reason
        )  # type: ignore[arg-type]
        return self._completion([choice], total_usage([done])).model_dump()

    def _chunk(self, completion: Completion) -> str:
        return f"data: {completion.model_dump_json()}\n\n"

    async def stream(self, job: Job) -> AsyncIterator[str]:
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        if self.echo:
            yield self._chunk(self._completion([CompletionChoice(text=self.echo)]))
        try:
            async for event in job.results():
                if isinstance(event, TextPiece):
                    choice = CompletionChoice(text=event.text, logprobs=self._logprobs([event]))
                    yield self._chunk(self._completion([choice]))
                elif event.finish_reason != "cancelled":
                    choice = CompletionChoice(text="", finish_reason=event.finish_reason)  # type: ignore[arg-type]
                    yield self._chunk(self._completion([choice]))
                    if include_usage:
                        yield self._chunk(self._completion([], total_usage([event])))
        except Exception as e:  # after the headers went out: an error event, as OpenAI sends
            yield f"data: {json.dumps(as_openai_error(e).body())}\n\n"
        yield "data: [DONE]\n\n"
