"""Text -> token ids in time linear in the text, whatever the text.

BPE tokenizers merge within a pre-token, and a run of characters with no whitespace is one
pre-token for most of them; the merge loop is quadratic in its length. On the embedded model's
tokenizer a 20 kB run (base64, minified JSON, "x" * n from a tool) took 2.4 s and a 40 kB one 10 s,
while 40 kB of words took 0.2 s. `encode` therefore hands the tokenizer long runs in slices of
`MAX_RUN` characters (never cutting an added or special token's text): the result is exactly the
tokenizer's own for any text without a whitespace-free run longer than `MAX_RUN`, and for longer
runs it differs only at the slice boundaries (still decoding to the same text).
"""

from __future__ import annotations

import re
from typing import Any

MAX_RUN = 1024
"""Longest whitespace-free run handed to the tokenizer at once (characters)."""

_LONG_RUN = re.compile(rf"\S{{{MAX_RUN + 1},}}")


def encode(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False)`, in linear time (module docstring)."""
    pieces = split_long_runs(text, _protected(tokenizer))
    if len(pieces) == 1:
        return list(tokenizer.encode(text, add_special_tokens=False))
    batch = tokenizer(pieces, add_special_tokens=False)["input_ids"]
    return [token for ids in batch for token in ids]


def split_long_runs(text: str, protected: tuple[str, ...] = ()) -> list[str]:
    """`text` cut inside whitespace-free runs longer than MAX_RUN, every MAX_RUN characters,
    never inside an occurrence of a `protected` string. "".join(result) == text."""
    cuts: list[int] = []
    for match in _LONG_RUN.finditer(text):
        cut = match.start() + MAX_RUN
        while cut < match.end():
            cut = _outside(text, cut, protected)
            if cut >= match.end():
                break
            cuts.append(cut)
            cut += MAX_RUN
    if not cuts:
        return [text]
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _outside(text: str, cut: int, protected: tuple[str, ...]) -> int:
    """`cut`, moved past any occurrence of a protected string that spans it."""
    for token in protected:
        n = len(token)
        if n < 2:
            continue
        start = text.find(token, max(0, cut - n + 1), cut + n - 1)
        while start != -1 and start < cut:
            if start + n > cut:
                return _outside(text, start + n, protected)
            start = text.find(token, start + 1, cut + n - 1)
    return cut


def _protected(tokenizer: Any) -> tuple[str, ...]:
    """The texts of the tokenizer's added (special and user) tokens."""
    vocab = getattr(tokenizer, "get_added_vocab", None)
    return tuple(vocab()) if callable(vocab) else tuple(getattr(tokenizer, "all_special_tokens", ()))
