"""Token sampling and the streaming decode loop."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from .detokenize import IncrementalDetokenizer
from .errors import MemoryBudgetError
from .stop_text import first_stop, held_back_for_stops

if TYPE_CHECKING:
    from .session import Session

logger = logging.getLogger(__name__)

FinishReason = Literal["length", "stop_token", "stop_string", "memory"]


class SamplingParams(BaseModel):
    """How the next token is picked. temperature 0 is greedy; `seed` makes sampling repeatable."""

    model_config = ConfigDict(frozen=True)

    max_new_tokens: int = Field(default=64, ge=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_k: int | None = Field(default=None, ge=1)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its id, the text it adds (empty without a tokenizer) and, on the
    last event, why generation ended."""

    token_id: int
    text: str
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int


class Sampler:
    """Picks tokens from logits [V] under SamplingParams.

    The draw happens on the CPU with a CPU generator whatever the logits' device: a seeded
    sampler picks the same tokens on a GPU as on the CPU (given the same probabilities), and a
    CPU generator cannot drive a CUDA multinomial ("Expected a 'cuda' device type for generator").
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.temperature == 0:
            return int(torch.argmax(logits))
        scores = logits.float() / p.temperature
        if p.top_k is not None and p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p is not None and p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
            # Drop tokens once the mass before them already reaches top_p (the first always stays).
            drop = cumulative - torch.softmax(sorted_scores, dim=-1) >= p.top_p
            scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
        probs = torch.softmax(scores, dim=-1).cpu()
        return int(torch.multinomial(probs, 1, generator=self.generator))


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
    sampler = Sampler(params)
    logits = session.prefill(prompt_ids, last_only=True)[-1]
    detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
    stops = set(params.stop_token_ids)
    text = ""  # the stable text of the tokens so far (empty without a tokenizer)
    emitted = 0  # characters of `text` already yielded
    # Never run past the model's context: the last token that fits ends generation ("length").
    steps = min(params.max_new_tokens, session.engine.max_context - session.position)
    for step in range(steps):
        token = sampler(logits)
        if token in stops:
            session.append_unprocessed(token)
            yield TokenEvent(token, _rest(detok, emitted), "stop_token")
            return
        searched = len(text)  # holds no stop string (else generation had ended)
        if detok is not None:
            detok.push(token)
            text = detok.text
        hit = first_stop(text, params.stop_strings, searched)
        if hit is not None:
            session.append_unprocessed(token)
            yield TokenEvent(token, text[emitted:hit], "stop_string")
            return
        if step == steps - 1:
            session.append_unprocessed(token)
            yield TokenEvent(token, _rest(detok, emitted), "length")
            return
        try:
            next_logits = session.decode(token)
        except MemoryBudgetError as e:
            logger.warning("generation stopped after %d tokens by a memory limit: %s", step + 1, e)
            session.append_unprocessed(token)
            yield TokenEvent(token, _rest(detok, emitted), "memory")
            return
        safe = len(text) - held_back_for_stops(text, params.stop_strings)
        yield TokenEvent(token, text[emitted:safe])
        emitted = safe
        logits = next_logits


def _rest(detok: IncrementalDetokenizer | None, emitted: int) -> str:
    """The text after the first `emitted` characters, an incomplete character at the end included
    (decoded as is): what the last event carries. Ends the detokenizer's stream."""
    if detok is None:
        return ""
    detok.flush()
    return detok.text[emitted:]
