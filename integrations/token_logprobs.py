"""Token logprobs as the OpenAI API shows them (`ChatCompletionTokenLogprob`): each generated
token's text and UTF-8 bytes beside its logprob, and the same for its most likely alternatives.

The logprobs are the engine's (`engine.sampling.TokenLogprob`): the raw model distribution,
before logit bias, penalties, temperature and grammar masks, as OpenAI and vLLM (its default
`raw_logprobs`) report them. A token's bytes are its piece of the vocabulary (the raw bytes: a
token holding part of a UTF-8 character has them, its text shows U+FFFD for them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from freetoken_agents.engine.runtime.sampling import TokenLogprob
    from freetoken_agents.model import FreeTokenModel

__all__ = ["LOGPROB_FLOOR", "TokenLogprobs", "TokenTexts", "TopLogprob"]

LOGPROB_FLOOR = -9999.0
"""What a logprob of -inf is reported as (JSON has no infinity; vLLM reports the same value)."""


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a position."""

    token: str
    bytes: tuple[int, ...]
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token: its text, bytes and logprob, and the `top_logprobs` alternatives (most
    likely first; as many as the request asked for)."""

    token: str
    bytes: tuple[int, ...]
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()


class TokenTexts:
    """Token id -> its text and bytes, for `backend`'s tokenizer (the vocabulary's byte pieces
    the grammar compiler decoded; the tokenizer's decode for a token without one)."""

    def __init__(self, backend: FreeTokenModel) -> None:
        self._pieces = backend.grammars().vocab.pieces
        self._tokenizer = backend.tokenizer

    def piece(self, token_id: int) -> bytes:
        piece = self._pieces[token_id] if 0 <= token_id < len(self._pieces) else b""
        return piece or self._tokenizer.decode([token_id]).encode("utf-8")

    def top(self, token_id: int, logprob: float) -> TopLogprob:
        piece = self.piece(token_id)
        return TopLogprob(piece.decode("utf-8", errors="replace"), tuple(piece), max(logprob, LOGPROB_FLOOR))

    def convert(self, entries: Sequence[TokenLogprob]) -> tuple[TokenLogprobs, ...]:
        out = []
        for e in entries:
            chosen = self.top(e.token_id, e.logprob)
            alternatives = tuple(self.top(t, lp) for t, lp in e.top)
            out.append(TokenLogprobs(chosen.token, chosen.bytes, chosen.logprob, alternatives))
        return tuple(out)
