"""What the constrained decoder needs to know about each token id of a vocabulary, computed once
per tokenizer (`TokenVocab`): which tokens are banned inside a value, which close one, and which
make the most progress towards closing one."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from .grounding import SpanIndex

__all__ = ["TokenVocab"]


class TokenVocab:
    """What the decoder needs to know about each token id, computed once per tokenizer.

    banned: special and added tokens, never allowed inside JSON (bool [V]).
    string_close / bracket_close: preference scores (-inf: not a closer) of tokens that end an
        open string (a quote, then only brackets or spaces) or close brackets (only `}`/`]`/spaces);
        higher closes more. progress: the fallback order when no closer is allowed (`_progress`).
    prefix_closers(text): scores of the tokens that write the start of `text` (a closing marker).
    """

    def __init__(self, info: Any, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self.size = vocab_size
        self.stop_ids = frozenset(stop_ids)
        pieces: list[bytes] = list(info.decoded_vocab)[:vocab_size]
        pieces += [b""] * (vocab_size - len(pieces))
        self.pieces = pieces
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self.banned_ids = frozenset(i for i in special if 0 <= i < vocab_size and i not in self.stop_ids)
        ninf = float("-inf")
        string_close, bracket_close, progress = ([ninf] * vocab_size for _ in range(3))
        for i, piece in enumerate(pieces):
            if not piece or i in self.banned_ids or i in self.stop_ids:
                continue
            progress[i] = _progress(piece)
            closing = sum(c in b"}]" for c in piece)
            if piece[:1] == b'"' and all(c in b" }]" for c in piece[1:]):
                string_close[i] = 1 + closing
            if closing and all(c in b" }]" for c in piece):
                bracket_close[i] = closing
        self.banned = torch.zeros(vocab_size, dtype=torch.bool)
        self.banned[list(self.banned_ids)] = True
        self.string_close = torch.tensor(string_close)
        self.bracket_close = torch.tensor(bracket_close)
        self.progress = torch.tensor(progress)
        self._banned_on: dict[torch.device, torch.Tensor] = {}
        self._ids: dict[bytes, int] | None = None  # piece -> a token id writing it (built on first use)
        self._prefix_closers: dict[bytes, torch.Tensor] = {}
        self._span_index: SpanIndex | None = None

    @property
    def span_index(self) -> SpanIndex:
        """The pieces by the string content they write (grounded arguments), built on first use."""
        if self._span_index is None:
            self._span_index = SpanIndex(self.pieces, self.banned_ids | self.stop_ids)
        return self._span_index

    def banned_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._banned_on:
            self._banned_on[device] = self.banned.to(device)
        return self._banned_on[device]

    def prefix_closers(self, text: bytes) -> torch.Tensor:
        """Scores [V] of the tokens whose piece is a prefix of `text`: its length (-inf: none)."""
        table = self._prefix_closers.get(text)
        if table is None:
            if self._ids is None:
                skip = self.banned_ids | self.stop_ids
                self._ids = {p: i for i, p in enumerate(self.pieces) if p and i not in skip}
            table = torch.full((self.size,), float("-inf"))
            for k in range(1, len(text) + 1):
                if (i := self._ids.get(text[:k])) is not None:
                    table[i] = float(k)
            self._prefix_closers[text] = table
        return table


_DIGITS = re.compile(rb"-?[0-9]+")


def _progress(piece: bytes) -> float:
    """How far a token goes towards finishing a value when nothing allowed closes one: an empty
    container or string in one token, then a separator to the next (required) property, then a
    whole number, a literal, a string's opening quote; else shorter is better."""
    core = piece.strip(b" ")
    if core in (b"[]", b"{}", b'""'):
        return 50.0
    if core[:1] == b"," and all(c in b' ,"' for c in core):
        return 40.0
    if _DIGITS.fullmatch(core):
        return 30.0 - len(core)
    if core in (b"true", b"false", b"null"):
        return 20.0
    if core == b'"':
        return 10.0
    return -float(len(piece))
