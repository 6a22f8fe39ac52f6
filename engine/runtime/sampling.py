"""How the next token is picked from a model's logits: `SamplingParams`, the logits processors,
the `Sampler`, and the per-token logprobs of the raw model distribution (`token_logprob`).

The processors run in vLLM v1's order (its sampler), all in float32 on the logits' device:

  1. penalties, on the logits as the model gave them (after a caller's logit bias):
     `repetition_penalty` over every token of the prompt and of the output (a positive logit is
     divided by it, a negative one multiplied: transformers' `RepetitionPenaltyLogitsProcessor`),
     then OpenAI's `frequency_penalty` and `presence_penalty` over the output tokens only
     (logit -= count * frequency + (count > 0) * presence), as vLLM counts them;
  2. greedy (temperature 0): the argmax of the penalised logits; the warpers below never change it;
  3. temperature, then `min_p`, `top_k`, `top_p` (transformers' `TemperatureLogitsWarper`,
     `MinPLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper` chained in that order give the
     same scores; `tests/test_sampling_reference.py` checks it), then one draw.

"Output" is what the caller reports with `Sampler.observe` (the tokens generated after the
prompt); the prompt is given once, at construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs and vLLM's default cap)


class SamplingParams(BaseModel):
    """How the next token is picked. temperature 0 is greedy; `seed` makes sampling repeatable.

    top_k / top_p / min_p (None: off) restrict a sampled draw; repetition_penalty (1: off),
    presence_penalty and frequency_penalty (0: off) change the logits, greedy ones included (see
    the module docstring for the order and which tokens each counts). logprobs: None for none, N
    for the chosen token's logprob and its N most likely alternatives (`TokenLogprob`), of the raw
    model distribution (before bias, penalties and temperature).
    """

    model_config = ConfigDict(frozen=True)

    max_new_tokens: int = Field(default=64, ge=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_k: int | None = Field(default=None, ge=1)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (else the sampler keeps no token counts)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob under the raw model distribution (log_softmax of the logits
    the model gave for its position) and the `top` most likely tokens there as (id, logprob),
    most likely first (as many as `SamplingParams.logprobs` asked; the chosen one may be among
    them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: torch.Tensor, token_id: int, top_n: int = 0) -> TokenLogprob:
    """`token_id`'s logprob under log_softmax(`logits` [V]) and the `top_n` best alternatives.
    One device-to-host copy."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if top_n > 0:
        values, ids = torch.topk(logprobs, min(top_n, logprobs.shape[-1]))
        row = torch.cat([logprobs[token_id].view(1), values]).tolist()
        top = tuple(zip(ids.tolist(), row[1:], strict=True))
        return TokenLogprob(token_id, row[0], top)
    return TokenLogprob(token_id, float(logprobs[token_id]))


def apply_penalties(
    logits: torch.Tensor,
    seen: torch.Tensor | None,
    counts: torch.Tensor | None,
    *,
    repetition: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
) -> torch.Tensor:
    """Penalised float32 copy of `logits` [V]. `seen` bool [V]: tokens in the prompt or the output
    (repetition); `counts` [V]: how often each token is in the output (presence, frequency)."""
    scores = logits.to(torch.float32, copy=True)
    if repetition != 1.0 and seen is not None:
        penalised = torch.where(scores < 0, scores * repetition, scores / repetition)
        scores = torch.where(seen, penalised, scores)
    if counts is not None:
        if frequency != 0.0:
            scores -= frequency * counts
        if presence != 0.0:
            scores -= presence * (counts > 0).to(scores.dtype)
    return scores


def warp(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`scores` [V] (float32, penalised) divided by the temperature, then min_p, top_k and top_p
    applied: dropped tokens get -inf. Only for temperature > 0."""
    scores = scores / params.temperature
    ninf = float("-inf")
    if params.min_p is not None and params.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), ninf)  # never the best
    if params.top_k is not None and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, ninf)
    if params.top_p is not None and params.top_p < 1.0:
        ascending, order = torch.sort(scores, descending=False)
        cumulative = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
        # drop the least likely tokens whose mass stays within 1 - top_p; the best always stays
        drop = cumulative <= 1 - params.top_p
        drop[-1] = False
        scores = scores.masked_fill(drop.scatter(0, order, drop), ninf)
    return scores


class Sampler:
    """Picks tokens from logits [V] under SamplingParams.

    `prompt_ids`: the tokens before the output (only repetition_penalty reads them). The caller
    reports each token that joins the output with `observe` (and one taken back with `forget`):
    the penalties count those, whoever picked them.

    The draw happens on the CPU with a CPU generator whatever the logits' device: a seeded
    sampler picks the same tokens on a GPU as on the CPU (given the same probabilities), and a
    CPU generator cannot drive a CUDA multinomial ("Expected a 'cuda' device type for generator").
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())
        self._prompt = list(prompt_ids) if params.repetition_penalty != 1.0 else []
        self._output: list[int] = []  # observed before the counts exist (built on first use)
        self._prompt_seen: torch.Tensor | None = None  # bool [V]
        self._counts: torch.Tensor | None = None  # float32 [V]: output occurrences

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.temperature == 0:
            if not p.penalized:  # the plain greedy path: the logits as they are
                return int(torch.argmax(logits))
            return int(torch.argmax(self.penalize(logits)))
        probs = torch.softmax(self.process(logits), dim=-1).cpu()
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] with the penalties applied (a float32 copy)."""
        p = self.params
        if not p.penalized:
            return logits.to(torch.float32, copy=True)
        seen, counts = self._state(logits)
        return apply_penalties(
            logits,
            seen,
            counts,
            repetition=p.repetition_penalty,
            presence=p.presence_penalty,
            frequency=p.frequency_penalty,
        )

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The scores a sampled draw uses (penalties, temperature, min_p, top_k, top_p; -inf for
        dropped tokens). Only for temperature > 0."""
        return warp(self.penalize(logits), self.params)

    def observe(self, token_id: int) -> None:
        """`token_id` joined the output (penalties count it from the next pick on)."""
        if not self.params.penalized:
            return
        if self._counts is None:
            self._output.append(token_id)
        else:
            self._counts[token_id] += 1

    def forget(self, token_ids: Sequence[int]) -> None:
        """These output tokens were taken back (cut from the context)."""
        if not self.params.penalized:
            return
        for t in token_ids:
            if self._counts is None:
                if t in self._output:
                    self._output.remove(t)
            elif self._counts[t] > 0:
                self._counts[t] -= 1

    def _state(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens in the prompt or the output: bool [V], output counts [V]) on `logits`' device."""
        if self._counts is None:
            vocab, device = logits.shape[-1], logits.device
            self._prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            if self._prompt:
                self._prompt_seen[torch.tensor(self._prompt, dtype=torch.long, device=device)] = True
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            if self._output:
                ids = torch.tensor(self._output, dtype=torch.long, device=device)
                self._counts.index_add_(0, ids, torch.ones(len(self._output), device=device))
            self._prompt, self._output = [], []
        assert self._prompt_seen is not None
        return self._prompt_seen | (self._counts > 0), self._counts
