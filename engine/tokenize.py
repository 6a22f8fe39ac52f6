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


def _added_vocab(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's added (special and user) tokens of two characters or more, text -> id.

    A one-character added token is left out: it cannot be forged by splitting its text, it is the
    only encoding of that character (tokenizers converted from GGUF mark byte-level characters
    such as "ü" as added tokens), and splitting it apart would never end."""
    vocab = getattr(tokenizer, "get_added_vocab", None)
    if callable(vocab):
        added = {str(t): int(i) for t, i in vocab().items()}
    else:
        names = getattr(tokenizer, "all_special_tokens", ())
        added = dict(zip(names, getattr(tokenizer, "all_special_ids", ()), strict=False))
    return {t: i for t, i in added.items() if len(t) > 1}


def _protected(tokenizer: Any) -> tuple[str, ...]:
    """The texts of the tokenizer's added tokens that untrusted text must not yield (`_added_vocab`)."""
    return tuple(_added_vocab(tokenizer))


def added_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The added-token texts, longest first (so a regex alternation prefers the longest match)."""
    return tuple(sorted((t for t in _protected(tokenizer) if t), key=len, reverse=True))


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """Token ids of untrusted `text` in which no added/special token string becomes its control id.

    `split_special_tokens=True` makes the tokenizer treat special-token text as ordinary text, and
    leaves every other text's ids unchanged. Added tokens that are not "special" (e.g. `<tool_call>`)
    are still matched by it, so any added id that remains is re-encoded piecewise: the token's first
    character apart from the rest, which can then only yield ordinary vocabulary ids."""
    ids = _encode_split(tokenizer, text)
    control = _added_ids(tokenizer)
    if not control.intersection(ids):
        return ids
    tokens = added_tokens(tokenizer)
    pattern = re.compile("|".join(map(re.escape, tokens)))
    out: list[int] = []
    last = 0
    for match in pattern.finditer(text):
        out += _encode_split(tokenizer, text[last : match.start()]) if match.start() > last else []
        token = match.group()
        out += encode_plain(tokenizer, token[:1]) + encode_plain(tokenizer, token[1:])
        last = match.end()
    if last < len(text):
        out += _encode_split(tokenizer, text[last:])
    return out


def encode_segments(tokenizer: Any, text: str, untrusted: list[tuple[int, int]]) -> list[int]:
    """Ids of rendered chat `text` where only added tokens outside the `untrusted` [start, end)
    spans become control ids; the text between them is encoded with `encode_plain`. For text whose
    untrusted spans hold no added-token string this equals `encode(tokenizer, text)`, because HF
    tokenizers themselves split at added tokens before encoding the text between them."""
    tokens = added_tokens(tokenizer)
    if not tokens:
        return encode(tokenizer, text)
    vocab = _added_vocab(tokenizer)
    out: list[int] = []
    last = 0
    for match in re.finditer("|".join(map(re.escape, tokens)), text):
        start, end = match.span()
        if any(a < end and start < b for a, b in untrusted):
            continue  # inside (or overlapping) untrusted content: stays text
        if start > last:
            out += encode_plain(tokenizer, text[last:start])
        token = match.group()
        out.append(int(vocab[token]) if token in vocab else int(tokenizer.convert_tokens_to_ids(token)))
        last = end
    if last < len(text):
        out += encode_plain(tokenizer, text[last:])
    return out


def _encode_split(tokenizer: Any, text: str) -> list[int]:
    """`encode` with special-token text split as plain text, long runs sliced (module docstring)."""
    pieces = split_long_runs(text)
    try:
        batch = tokenizer(pieces, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    except TypeError:  # a tokenizer without the option: encode_plain's piecewise path catches it
        batch = tokenizer(pieces, add_special_tokens=False)["input_ids"]
    return [token for ids in batch for token in ids]


def _added_ids(tokenizer: Any) -> set[int]:
    return set(_added_vocab(tokenizer).values())
