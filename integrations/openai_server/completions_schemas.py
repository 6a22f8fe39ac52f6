"""The legacy completions wire format (POST /v1/completions), as pydantic models: raw text in
(no chat template), raw text out, as code-completion plugins send it.

Fields whose effect the server cannot give are refused with a 400 naming them (`n` > 1,
`best_of` > 1, a `suffix`, several prompts, `echo` with `logprobs`), never accepted and ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .schemas import StopRequest, StreamOptions, Usage

_LENIENT = ConfigDict(extra="ignore")

MAX_LOGPROBS = 5  # OpenAI's bound on the legacy `logprobs` integer


class CompletionRequest(StopRequest):
    """POST /v1/completions. `prompt`: a string, a list of one string, a list of token ids or a
    list of one such list. `max_tokens` defaults to 16, as OpenAI's does; 0 with `echo` returns
    the prompt alone."""

    model_config = _LENIENT

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    logit_bias: dict[str, float] | None = None
    n: int | None = Field(default=None, ge=1)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    user: str | None = Field(default=None, max_length=256)  # scopes prefix reuse (with the API key)


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


class CompletionLogprobs(BaseModel):
    """Per-token log-probabilities in the legacy shape: the tokens' texts, the log-probability of
    each under the model (before temperature and top_p), the `logprobs` most likely alternatives
    at each step (text -> log-probability) and where each token's text starts in `text`."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


CompletionUsage = Usage  # the same counts, in the same shape, as a chat completion's


class Completion(BaseModel):
    """The answer, whole (`object` "text_completion") or as one stream chunk of it (the same
    object with a piece of the text; the last chunk with `usage` has no choices)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None
