"""One constrained value under a compiled grammar (xgrammar's matcher): the logits mask (the
grammar's, special tokens', grounding's), accepted tokens, jump-forward tokens, and the cost in
sampled tokens of closing the value from where it stands (simulated on a fork of the matcher).
`JsonConstraint` for a JSON value or an XML call body, `TextConstraint` for a reply's text under
a `grammar_factory.TextGrammar` (no closing guarantee). `constrained.ConstrainedDecode` drives
them; `grammar_factory.GrammarFactory` makes them."""

from __future__ import annotations

from typing import Any

import torch

from ._body_formats import JsonLexer, XmlParamsLexer
from .grounding import SpanGrounding
from .token_vocab import TokenVocab

_SIMULATION_LIMIT = 256  # steps a closing-cost simulation may take before it counts as "too many"


def load_xgrammar() -> Any:
    """The xgrammar module, or an ImportError saying how to install it."""
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "constrained decoding needs xgrammar: pip install --no-deps xgrammar==0.2.9 (CPU), "
            "or pip install 'freetoken-agents[cuda]' on an NVIDIA machine"
        ) from e
    return xgrammar


class JsonConstraint:
    """One value under a compiled grammar: mask logits, accept tokens, jump forward, and the cost
    (in tokens) of closing the value from the current state. `lexer` tells the closing policy
    where the value stands (`_body_formats`): a JSON value's by default. `grounding` further masks
    the tokens of plain string fields to spans of the conversation (None: the grammar alone).
    `string_limit`: the characters a string may run to before the decoder closes it
    (`schema_bounds.string_limit`; None: no limit)."""

    def __init__(
        self,
        compiled: Any,
        vocab: TokenVocab,
        lexer: JsonLexer | XmlParamsLexer | None = None,
        grounding: SpanGrounding | None = None,
        string_limit: int | None = None,
    ) -> None:
        xgr = load_xgrammar()
        self._xgr = xgr
        self.vocab = vocab
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab.size)
        self.lexer = lexer if lexer is not None else JsonLexer()
        self.grounding = grounding
        self.string_limit = string_limit

    # ---- state -----------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        """The text so far is a complete value (more may still be allowed: digits of a number)."""
        return self.matcher.is_completed()

    @property
    def finished(self) -> bool:
        """Complete and closed: nothing but the end may follow."""
        return self.complete and self.lexer.closed

    @property
    def string_ran_long(self) -> bool:
        """The open string has reached `string_limit` characters: it must close now."""
        return self.string_limit is not None and self.lexer.string_chars >= self.string_limit

    # ---- steps -----------------------------------------------------------------------------------
    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the logits [V] of tokens the grammar forbids, and of special tokens, to -inf."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        view = logits.view(1, -1) if logits.dim() == 1 else logits
        self._xgr.apply_token_bitmask_inplace(view, self.bitmask.to(logits.device))
        flat = logits.view(-1)
        flat[: self.vocab.size].masked_fill_(
            self.vocab.banned_on(logits.device)[: flat.numel()], float("-inf")
        )
        if self.grounding is not None:
            self.grounding.restrict_(logits)
        return logits

    def restrict_to_closing_(self, logits: torch.Tensor) -> torch.Tensor:
        """Keep only (already masked) logits [V] of tokens on a short way to closing the value:
        the closers of an open string or of brackets when any is allowed, else the allowed tokens
        that progress most (`_progress`)."""
        flat = logits.view(-1)
        allowed = torch.isfinite(flat)
        keep = torch.zeros_like(allowed)
        for closers in self.lexer.closers(self.vocab):
            keep = allowed & torch.isfinite(closers.to(flat.device)[: flat.numel()])
            if bool(keep.any()):
                break
        if not bool(keep.any()):
            scores = self.vocab.progress.to(flat.device)[: flat.numel()].masked_fill(~allowed, float("-inf"))
            keep = allowed & (scores == scores.max())
        stop = torch.zeros_like(allowed)
        for i in self.vocab.stop_ids:
            if i < flat.numel():
                stop[i] = bool(allowed[i])  # a complete number may end here
        flat.masked_fill_(~(keep | stop), float("-inf"))
        return logits

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            raise RuntimeError(f"grammar rejected token {token_id} it allowed")
        self.lexer.feed(self.vocab.pieces[token_id])
        if self.grounding is not None:
            self.grounding.feed(self.vocab.pieces[token_id])

    def jump_forward(self) -> list[int]:
        """Tokens the grammar allows no alternative to from here (may be empty); not accepted yet."""
        return _up_to_banned(self.matcher.find_jump_forward_tokens(), self.vocab.banned_ids)

    def forced_text(self) -> str:
        """Text the grammar allows no alternative to from here (may be empty)."""
        return self.matcher.find_jump_forward_string()

    def closing_cost(self, after: int | None = None) -> int:
        """Sampled tokens needed to finish the value from here (after accepting `after`, if
        given), following the closing policy: jump-forwards (free), then the best-closing allowed
        token. The state is untouched (the walk runs on a fork of the matcher)."""
        matcher, lexer = self.matcher.fork(), self.lexer.copy()
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab.size)
        cost = 0
        if after is not None:
            if not matcher.accept_token(after):
                return _SIMULATION_LIMIT
            lexer.feed(self.vocab.pieces[after])
        for _ in range(_SIMULATION_LIMIT):
            if matcher.is_completed() and (lexer.closed or self._stop_allowed(matcher, bitmask)):
                return cost
            forced = _up_to_banned(matcher.find_jump_forward_tokens(), self.vocab.banned_ids)
            steps = forced or [self._closing_choice(matcher, lexer, bitmask)]
            for t in steps:
                if t < 0 or not matcher.accept_token(t):
                    return _SIMULATION_LIMIT
                lexer.feed(self.vocab.pieces[t])
            cost += 0 if forced else 1
        return _SIMULATION_LIMIT

    def closing_choice(self) -> int:
        """The closing policy's next token from here (the first step `closing_cost` counts)."""
        return self._closing_choice(self.matcher, self.lexer, self.bitmask)

    # ---- internals -------------------------------------------------------------------------------
    def _stop_allowed(self, matcher: Any, bitmask: torch.Tensor) -> bool:
        matcher.fill_next_token_bitmask(bitmask)
        return any(self._allowed(bitmask, i) for i in self.vocab.stop_ids)

    @staticmethod
    def _allowed(bitmask: torch.Tensor, token_id: int) -> bool:
        return bool((int(bitmask[0, token_id // 32]) >> (token_id % 32)) & 1)

    def _closing_choice(self, matcher: Any, lexer: JsonLexer | XmlParamsLexer, bitmask: torch.Tensor) -> int:
        """The closing policy's token (no logits: by preference score), or -1 when stuck."""
        matcher.fill_next_token_bitmask(bitmask)
        for table in (*lexer.closers(self.vocab), self.vocab.progress):
            scores = table.clone().view(1, -1)
            self._xgr.apply_token_bitmask_inplace(scores, bitmask)
            best = int(torch.argmax(scores))
            if torch.isfinite(scores[0, best]):
                return best
        return -1


class TextConstraint(JsonConstraint):
    """A reply's text under a `TextGrammar` (a regex, an EBNF/GBNF grammar, a choice). The JSON
    closing policy (close the open string, then the brackets) means nothing here, and the shortest
    way to a grammar's end is not known without searching it: so no closing guarantee. The text
    ends where the model ends it and the grammar allows (or allows nothing more), else at its
    budget, finish_reason "length" and possibly mid-pattern, as vLLM's and llama-server's
    grammar outputs do."""

    @property
    def finished(self) -> bool:
        return False  # only the stop token ends it: the grammar allows it once the text is complete

    def closing_cost(self, after: int | None = None) -> int:
        return 0  # nothing to steer towards: `ConstrainedDecode` never forces a closing token


def _up_to_banned(tokens: list[int], banned: frozenset[int]) -> list[int]:
    """`tokens` up to the first banned one (the grammar's literal text is then sampled instead)."""
    for i, t in enumerate(tokens):
        if t in banned:
            return tokens[:i]
    return tokens
