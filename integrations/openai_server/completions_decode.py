"""One legacy completion on the engine: raw text after a raw prompt, no chat template, no tool
calls, no reasoning block, no anchors mid-turn (the chat turn's decoder does all of those, which a
code-completion prompt must not get). The prompt goes through the server's prefix cache like a
chat prompt; then each step samples from the model's logits (`engine.sampling.Sampler`:
temperature, top_p, seed, presence and frequency penalties; logit bias added first), stops at an
end-of-text token, a stop string or the token bound, and streams the stable text, holding back
what may begin a stop string (as `engine.generate.stream_tokens` does on a bare session).

`run_raw_completion` yields `TextPiece`s then one `RawFinished`; it runs on the engine's step
worker and checks `cancelled()` before every token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from freetoken_agents.engine import (
    IncrementalDetokenizer,
    MemoryBudgetError,
    SamplingParams,
    held_back_for_stops,
)
from freetoken_agents.engine.runtime.sampling import Sampler, token_logprob
from freetoken_agents.engine.text.stop_text import first_stop

from ..prefix_cache import PrefixCache, prepare_context, record_context
from ..token_logprobs import TokenTexts

if TYPE_CHECKING:
    from freetoken_agents.model import FreeTokenModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RawRequest:
    """ids: the prompt's token ids. max_tokens: tokens to sample at most (the context's end
    bounds them too). logprobs: the alternatives to report per token (None: no log-probabilities
    are computed at all)."""

    ids: list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None


@dataclass(frozen=True)
class LegacyLogprob:
    """One sampled token: its text, its log-probability under the model (the raw logits: before
    temperature, top_p, penalties and logit bias: `engine.sampling.token_logprob`), the
    `logprobs` likeliest tokens there (text -> logprob), and where its text starts in the
    completion's text (characters)."""

    token: str
    logprob: float
    top: dict[str, float]
    offset: int


@dataclass(frozen=True)
class TextPiece:
    """Text the completion made stable, and the tokens sampled since the last piece (with their
    log-probabilities when asked; a token's text may arrive in a later piece than the token)."""

    text: str
    tokens: tuple[LegacyLogprob, ...] = ()


@dataclass(frozen=True)
class RawFinished:
    """finish_reason: stop (an end-of-text token or a stop string), length, or cancelled."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


RawEvent = TextPiece | RawFinished


def run_raw_completion(
    backend: FreeTokenModel,
    cache: PrefixCache,
    req: RawRequest,
    *,
    reuse: bool,
    cancelled: Callable[[], bool] = lambda: False,
    tenant: str = "",
) -> Iterator[RawEvent]:
    """Generate the continuation of `req.ids` (see the module docstring). Prefix reuse is
    `tenant`'s own; the prompt and its continuation are pinned in `cache` afterwards."""
    cached = prepare_context(backend, cache, req.ids, reuse=reuse, tenant=tenant)
    params = SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
    )
    sample = Sampler(params, req.ids)
    texts = TokenTexts(backend) if req.logprobs is not None else None
    bias = _bias(req.logit_bias, backend.vocab_size)
    detok = IncrementalDetokenizer(backend.tokenizer)
    stop_ids = set(backend.stop_ids)
    text, emitted, finish, cut = "", 0, "length", False
    pending: list[LegacyLogprob] = []
    steps = min(req.max_tokens, backend.max_context - len(req.ids))
    for step in range(steps):
        if cancelled():
            finish = "cancelled"
            break
        logits = backend.next_logits()
        token = sample(logits if bias is None else logits + bias.to(logits.device, logits.dtype))
        sample.observe(token)  # the penalties count the output
        if token in stop_ids:
            backend.append_pending(token)  # it runs with the next prompt: ending costs no step
            finish = "stop"
            break
        if texts is not None and req.logprobs is not None:
            pending.append(_logprob(texts, logits, token, req.logprobs, len(detok.text)))
        searched = len(text)  # holds no stop string (else the completion had ended)
        detok.push(token)
        text = detok.text
        hit = first_stop(text, req.stop, searched)
        if hit is not None:
            backend.append_pending(token)
            text, finish, cut = text[:hit], "stop", True
            break
        if step == steps - 1:
            backend.append_pending(token)  # the last token: no step needed for logits after it
            break
        try:
            backend.decode(token)
        except MemoryBudgetError as e:  # the KV budget is full: what was sampled is delivered
            logger.warning("a completion stopped after %d tokens by the memory limit: %s", step + 1, e)
            backend.append_pending(token)
            break
        safe = len(text) - held_back_for_stops(text, req.stop)
        if safe > emitted or pending:
            yield TextPiece(text[emitted:safe], tuple(pending))
            emitted, pending = max(emitted, safe), []
    completion = max(0, backend.position - len(req.ids))
    if finish == "cancelled":
        yield RawFinished(finish, len(req.ids), completion, cached)
        return
    if not cut:
        detok.flush()  # an incomplete character at the end, decoded as is
        text = detok.text
    if len(text) > emitted or pending:
        yield TextPiece(text[emitted:], tuple(pending))
    if reuse:
        record_context(backend, cache, tenant)
    yield RawFinished(finish, len(req.ids), completion, cached)


def _logprob(texts: TokenTexts, logits: torch.Tensor, token: int, k: int, offset: int) -> LegacyLogprob:
    entry = token_logprob(logits, token, k)
    chosen = texts.top(token, entry.logprob)
    top: dict[str, float] = {}
    for tid, value in entry.top:
        alternative = texts.top(tid, value)
        top.setdefault(alternative.token, alternative.logprob)  # two ids may spell the same text
    return LegacyLogprob(chosen.token, chosen.logprob, top, offset)


def _bias(bias: dict[int, float], vocab_size: int) -> torch.Tensor | None:
    """logit_bias as a dense [V] tensor added to the logits before sampling; None when empty."""
    if not bias:
        return None
    out = torch.zeros(vocab_size)
    for token, value in bias.items():
        out[token] = value
    return out
