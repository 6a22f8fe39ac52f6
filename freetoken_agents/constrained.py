"""Grammar-constrained decoding of JSON values (and of Qwen3-Coder's XML call bodies, whose
values are JSON or raw text: `GrammarFactory.xml_parameters`): the one path every constrained
output takes.

Tool-call arguments in an Agent turn, ChatFreeToken's forced calls and `with_structured_output`,
and (later) the OpenAI-compatible server all decode through `ConstrainedDecode`:

- the grammar comes from a `GrammarFactory` (xgrammar), compiled from the schema as given:
  properties keep their declared order (a schema sorted with `sort_keys=True` put "arguments"
  before "name", an order the model never saw, and it wrote garbage);
- special and added tokens (`<|im_start|>`, `<tool_call>`, ...) are masked out: inside a JSON
  string the grammar alone would accept them as literal text;
- forced stretches (keys, punctuation) are jump-forwarded: prefilled in one batch, not decoded;
- the value always closes inside its budget of sampled tokens (forced text is the schema's, not
  the model's, and costs no decode step, so it does not count): near the end of the budget every
  sampled token is checked against the cost of closing from there (simulated on a fork of the
  matcher), and a token that would leave too little is replaced by a closing one (a string's
  quote, a bracket). A budget below the schema's smallest completion is the caller's error
  (TokenLimitTooSmall).

Why xgrammar: maintained (MLC), CPU bitmask kernels (~20 us/token at a small vocab), JSON-schema
compile in ~1.5 ms, jump-forward tokens and matcher forks. outlines-core has no jump-forward API.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal, Protocol

import torch

from freetoken_agents.engine.runtime.generate import Sampler

from .detokenize import IncrementalDetokenizer
from .grammar_factory import GRAMMAR_CACHE_SIZE, GrammarFactory, TextGrammar
from .json_constraint import JsonConstraint, TextConstraint
from .tool_choice import NamedToolChoice, ToolChoice, resolve_tool_choice

# The constrained decoder's parts, importable from here as before the split (issue 64).
__all__ = [
    "CLOSING_SLACK",
    "GRAMMAR_CACHE_SIZE",
    "ConstrainedDecode",
    "GrammarFactory",
    "JsonConstraint",
    "NamedToolChoice",
    "TextConstraint",
    "TextGrammar",
    "TokenStepper",
    "ToolChoice",
    "resolve_tool_choice",
]

CLOSING_SLACK = 8
"""Start checking each sampled token against the closing cost this many tokens before the
budget could run out (one token seldom adds more than this to the cost of closing)."""


class TokenStepper(Protocol):
    """What ConstrainedDecode needs of a model: the next-token logits and a way to append tokens."""

    def next_logits(self) -> torch.Tensor: ...
    def decode(self, token_id: int) -> None: ...
    def prefill(self, token_ids: Sequence[int]) -> None: ...


class ConstrainedDecode:
    """Decode one JSON value under `constraint` on `model`, sampling at most `budget` tokens
    (jump-forwarded text does not count) and appending at most `room` tokens in all (the
    context's limit; None: no limit). Iterate it for text deltas; afterwards `finish_reason` is
    "stop" (the value is complete) or "length" (a limit ran out first: only when `budget` is
    below `min_tokens`, or `room` is too small), and `token_ids` holds what was appended.

    The stop token is never appended: ending the turn is the caller's business.
    """

    def __init__(
        self,
        model: TokenStepper,
        constraint: JsonConstraint,
        *,
        budget: int,
        sampler: Sampler,
        tokenizer: Any,
        room: int | None = None,
    ) -> None:
        self.model, self.constraint, self.budget, self.sampler = model, constraint, budget, sampler
        self.room = room
        self.detok = IncrementalDetokenizer(tokenizer)
        self.min_tokens = constraint.closing_cost()
        self.sampled = 0
        self.finish_reason: Literal["stop", "length"] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.detok.ids

    @property
    def text(self) -> str:
        return self.detok.text

    def __iter__(self) -> Iterator[str]:
        c, stops = self.constraint, self.constraint.vocab.stop_ids
        room = self.room if self.room is not None else float("inf")
        need = self.min_tokens
        self.finish_reason = "length"
        while True:
            if c.finished:
                self.finish_reason = "stop"
                break
            if len(self.detok) >= room:
                break
            forced = c.jump_forward()  # free: it costs no sampled token
            if forced:
                forced = forced[: int(min(len(forced), room - len(self.detok)))]
                for t in forced:
                    c.accept(t)
                self.model.prefill(forced)
                yield self.detok.extend(forced)
                continue
            remaining = self.budget - self.sampled
            if remaining <= 0:
                break
            logits = c.mask_(self.model.next_logits().clone())
            if c.string_ran_long:  # a free string at its bound (`schema_bounds`): close it now
                logits = c.restrict_to_closing_(logits)
            token = self.sampler(logits)
            if remaining <= need + CLOSING_SLACK and token not in stops:
                need = c.closing_cost(after=token)
                if 1 + need > remaining:  # this token would leave too little: close instead,
                    token = self.sampler(c.restrict_to_closing_(logits))  # the model's way,
                    need = c.closing_cost(after=token) if token not in stops else 0
                    if 1 + need > remaining:  # or the policy's, which costs what was planned
                        token = c.closing_choice()
                        need = c.closing_cost(after=token)
            if token in stops:  # allowed only once the value is complete (a number's end)
                self.finish_reason = "stop"
                break
            c.accept(token)
            self.model.decode(token)
            self.sampled += 1
            yield self.detok.push(token)
        yield self.detok.flush()
