"""What a turn records about each token it generates, wherever it was sampled (free text, a tool
call's arguments, a JSON reply): the sampler's output counts (presence / frequency / repetition
penalties) and, when asked, the token's logprob under the raw model distribution.

A generated token is reported just before the model runs it, when the model's next-token logits
are still those it was sampled from (the raw ones: bias, grammar masks, penalties and
temperature are applied to copies). Tokens the grammar or an assistant prefix forced are not
generated here: they get no logprob and no penalty count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence
from typing import Protocol

import torch

from freetoken_agents.engine.runtime.sampling import Sampler, TokenLogprob, token_logprob

from .backend import GenEvent


class Stepper(Protocol):
    """The model steps a turn drives (FreeTokenModel has them)."""

    @property
    def position(self) -> int: ...
    def next_logits(self) -> torch.Tensor: ...
    def decode(self, token_id: int) -> None: ...
    def prefill(self, token_ids: Sequence[int]) -> None: ...


class TurnOutput:
    """The turn's generated tokens, as the sampler's penalties and the logprobs see them.

    `top_n`: None (no logprobs) or how many alternatives each token's entry lists."""

    def __init__(self, model: Stepper, sampler: Sampler, top_n: int | None) -> None:
        self.model, self.sampler, self.top_n = model, sampler, top_n
        self._entries: list[tuple[int, TokenLogprob]] = []  # (position, entry) not delivered yet

    @property
    def records(self) -> bool:
        """Whether anything is recorded per token (else the model's own steps do)."""
        return self.top_n is not None or self.sampler.params.penalized

    def generated(self, token_id: int) -> None:
        """`token_id` was sampled for the model's next position and is about to be run there."""
        if self.top_n is not None:
            position = self.model.position
            self._drop_from(position)  # a position decoded again after a cut: the new token's
            self._entries.append((position, token_logprob(self.model.next_logits(), token_id, self.top_n)))
        self.sampler.observe(token_id)

    def taken_back(self, token_ids: Sequence[int]) -> None:
        """These generated tokens were cut from the context (the model's position is before them)."""
        self.sampler.forget(token_ids)
        self._drop_from(self.model.position)

    def take(self) -> tuple[TokenLogprob, ...]:
        """The entries recorded since the last take, in order."""
        out = tuple(entry for _, entry in self._entries)
        self._entries = []
        return out

    def attach(self, events: Generator[GenEvent, None, None]) -> Generator[GenEvent, None, None]:
        """`events` with the entries recorded before each one on it (anchors carry none); closing
        it closes `events`."""
        try:
            for event in events:
                if self._entries and event.kind != "anchor":
                    event = dataclasses.replace(event, logprobs=self.take())
                yield event
        finally:
            events.close()

    def _drop_from(self, position: int) -> None:
        while self._entries and self._entries[-1][0] >= position:
            self._entries.pop()


class RecordingStepper:
    """`model`'s steps, reporting each decoded token to `output` first: what the constrained decoder
    drives, so the tokens it samples count like free ones."""

    def __init__(self, model: Stepper, output: TurnOutput) -> None:
        self.model, self.output = model, output

    @property
    def position(self) -> int:
        return self.model.position

    def next_logits(self) -> torch.Tensor:
        return self.model.next_logits()

    def decode(self, token_id: int) -> None:
        self.output.generated(token_id)
        self.model.decode(token_id)

    def prefill(self, token_ids: Sequence[int]) -> None:
        self.model.prefill(token_ids)
