"""The adapter's backend: FreeTokenModel plus what a LangChain call needs on top of it.

- Tool-call and structured-output grammars that always finish inside their token budget: past
  half the budget the sampler only picks, among the tokens the grammar allows, those that close a
  string, array or object, so a weak (or random) model still ends with schema-valid JSON instead
  of an unterminated call. A model that closes its values on its own never notices.
- Whole-turn JSON generation under a schema (`with_structured_output(method="json_schema")`).
- Restoring a cached prefix from an engine anchor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import torch

from freetoken_agents.constrained import GrammarFactory, JsonConstraint
from freetoken_agents.engine import SamplingParams
from freetoken_agents.engine.generate import Sampler
from freetoken_agents.model import FreeTokenModel

logger = logging.getLogger(__name__)

_CLOSERS = ('"', "}", "]")


class BudgetedConstraint(JsonConstraint):
    """A JsonConstraint that steers towards completion after `soft_limit` sampled tokens."""

    def __init__(self, compiled: Any, vocab_size: int, closers: torch.Tensor, soft_limit: int) -> None:
        super().__init__(compiled, vocab_size)
        self.closers = closers  # bool [V]: tokens whose text closes a JSON string/array/object
        self.soft_limit = soft_limit
        self.steps = 0

    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        super().mask_(logits)
        self.steps += 1
        if self.steps > self.soft_limit:
            flat = logits.view(-1)
            closing = torch.isfinite(flat) & self.closers[: flat.numel()]
            if bool(closing.any()):
                flat.masked_fill_(~closing, float("-inf"))
        return logits


class BudgetedGrammarFactory(GrammarFactory):
    """GrammarFactory whose constraints are `BudgetedConstraint`s (soft limit in sampled tokens)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...], soft_limit: int) -> None:
        super().__init__(tokenizer, vocab_size, stop_ids)
        self.soft_limit = soft_limit
        closers = torch.zeros(vocab_size, dtype=torch.bool)
        for i in range(min(len(tokenizer), vocab_size)):
            piece = tokenizer.decode([i], skip_special_tokens=False)
            closers[i] = any(c in piece for c in _CLOSERS) and "\\" not in piece
        self.closers = closers

    def json_schema(self, schema: dict[str, Any]) -> JsonConstraint:
        key = json.dumps(schema, sort_keys=True)
        if key not in self._cache:  # same compile and cache as GrammarFactory.json_schema
            self._cache[key] = self.compiler.compile_json_schema(key, any_whitespace=False, strict_mode=True)
        return BudgetedConstraint(self._cache[key], self.vocab_size, self.closers, self.soft_limit)


class LangChainBackend(FreeTokenModel):
    """FreeTokenModel with budget-safe grammars, schema-constrained turns and anchor restores."""

    def __init__(self, engine: Any, *, family: str | None = None, soft_limit: int = 96) -> None:
        super().__init__(engine, family=family)
        self.soft_limit = soft_limit

    def grammars(self) -> GrammarFactory:
        if self._grammars is None:
            self._grammars = BudgetedGrammarFactory(
                self.tokenizer, self.engine.spec.vocab_size, self.stop_ids, self.soft_limit
            )
        return self._grammars

    def set_call_budget(self, max_call_tokens: int) -> None:
        """Start closing JSON values after half of `max_call_tokens` sampled tokens."""
        self.soft_limit = max(4, max_call_tokens // 2)
        if isinstance(self._grammars, BudgetedGrammarFactory):
            self._grammars.soft_limit = self.soft_limit

    def restore(self, anchor: Any) -> None:
        """Make the session the state pinned by engine `anchor` (pointer work, no prefill).

        Raises the engine's AnchorNotFoundError / AnchorValidationError, leaving it unchanged."""
        self.session.rollback(anchor)
        self._logits = None
        self.anchors.forget_after(0)  # agent-level anchor handles refer to the old branch

    def generate_json(
        self, schema: dict[str, Any], *, max_tokens: int, temperature: float, seed: int | None
    ) -> Iterator[str]:
        """Decode one JSON value under `schema` from the current context; yield text deltas.

        Forced stretches (keys, punctuation) are prefilled in one batch (jump-forward)."""
        constraint = self.grammars().json_schema(schema)
        sample = Sampler(SamplingParams(temperature=temperature, seed=seed))
        ids: list[int] = []
        emitted = 0
        for _ in range(max_tokens):
            if constraint.complete:
                break
            forced = constraint.forced_text()
            if forced:
                constraint.accept_text(forced)
                new = self.tokenizer.encode(forced, add_special_tokens=False)
                self._prefill(new)
                ids.extend(new)
            else:
                logits = constraint.mask_(self.next_logits().clone())
                token = sample(logits)
                if token in self.stop_ids:
                    break
                constraint.accept(token)
                ids.append(token)
                self._decode(token)
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            if len(text) > emitted and not text.endswith("\ufffd"):
                yield text[emitted:]
                emitted = len(text)
        if self.stop_ids:
            self.session.append_unprocessed(self.stop_ids[0])
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if len(text) > emitted:
            yield text[emitted:]
