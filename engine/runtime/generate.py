"""The streaming decode loop (`stream_tokens`); how a token is picked is `sampling.py`'s."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..errors import MemoryBudgetError
from ..text.detokenize import IncrementalDetokenizer
from ..text.stop_text import first_stop, held_back_for_stops
from .sampling import Sampler, SamplingParams, TokenLogprob, token_logprob

if TYPE_CHECKING:
    from .session import Session

logger = logging.getLogger(__name__)

__all__ = ["GenerationResult", "Sampler", "SamplingParams", "TokenEvent", "TokenLogprob", "stream_tokens"]

FinishReason = Literal["length", "stop_token", "stop_string", "memory"]


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its id, the text it adds (empty without a tokenizer), on the last
    event why generation ended, and its logprob when `SamplingParams.logprobs` asked for it."""

    token_id: int
    text: str
    finish_reason: FinishReason | None = None
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int


def stream_tokens(
    session: Session, prompt_ids: Sequence[int], params: SamplingParams, tokenizer: object | None
) -> Iterator[TokenEvent]:
    """Prefill `prompt_ids` into `session`, then decode until a stop condition.

    Text is detokenised incrementally (`IncrementalDetokenizer`: bounded tokenizer work per
    token); the events' texts concatenate to the whole decode of the generated ids (stop token
    and cut stop string excepted). The stop token itself is not emitted as text but is reported
    as the last event's token.
    With stop strings, text that could be the start of a stop string is held back until it is
    known not to be; a stop string is cut from the text and generation ends at the token that
    completed it. The last token is appended to the session as pending (not yet run), so the
    session holds the whole sequence and a later prefill continues from it.

    A token's event is yielded once the model has run it (its KV is cached), so when a memory
    limit (`MemoryBudgetError`: the KV cache or the fast budget is full) stops generation, the
    tokens produced so far are all delivered: the last one ends with finish_reason "memory".
    A prompt that does not fit raises MemoryBudgetError (nothing was produced).
    """
    if params.max_new_tokens == 0:
        return
    logits = session.prefill(prompt_ids, last_only=True)[-1]
    # the prompt is the whole sequence before the output (repetition_penalty counts it all)
    sampler = Sampler(params, session.token_ids if params.repetition_penalty != 1.0 else ())
    top_n = params.logprobs
    detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
    stops = set(params.stop_token_ids)
    text = ""  # the stable text of the tokens so far (empty without a tokenizer)
    emitted = 0  # characters of `text` already yielded
    # Never run past the model's context: the last token that fits ends generation ("length").
    steps = min(params.max_new_tokens, session.engine.max_context - session.position)
    for step in range(steps):
        token = sampler(logits)
        sampler.observe(token)
        lp = token_logprob(logits, token, top_n) if top_n is not None else None  # the raw logits'
        if token in stops:
            session.append_unprocessed(token)
            yield TokenEvent(token, _rest(detok, emitted), "stop_token", lp)
            return
        searched = len(text)  # holds no stop string (else generation had ended)
        if detok is not None:
            detok.push(token)
            text = detok.text
        hit = first_stop(text, params.stop_strings, searched)
        if hit is not None:
            session.append_unprocessed(token)
            yield TokenEvent(token, text[emitted:hit], "stop_string", lp)
            return
        if step == steps - 1:
            session.append_unprocessed(token)
            yield TokenEvent(token, _rest(detok, emitted), "length", lp)
            return
        try:
            next_logits = session.decode(token)
        except MemoryBudgetError as e:
            logger.warning("generation stopped after %d tokens by a memory limit: %s", step + 1, e)
            session.append_unprocessed(token)
            yield TokenEvent(token, _rest(detok, emitted), "memory", lp)
            return
        safe = len(text) - held_back_for_stops(text, params.stop_strings)
        yield TokenEvent(token, text[emitted:safe], logprob=lp)
        emitted = safe
        logits = next_logits


def _rest(detok: IncrementalDetokenizer | None, emitted: int) -> str:
    """The text after the first `emitted` characters, an incomplete character at the end included
    (decoded as is): what the last event carries. Ends the detokenizer's stream."""
    if detok is None:
        return ""
    detok.flush()
    return detok.text[emitted:]
