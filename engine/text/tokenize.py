"""Text -> token ids in time linear in the text, whatever the text, and as the tokenizer itself
would tokenize the text around each piece.

BPE tokenizers merge within a pre-token, and a run of characters with no whitespace is one
pre-token for most of them; the merge loop is quadratic in its length. On the embedded model's
tokenizer a 20 kB run (base64, minified JSON, "x" * n from a tool) took 2.4 s and a 40 kB one 10 s,
while 40 kB of words took 0.2 s. `encode` therefore hands the tokenizer long runs in slices of
`MAX_RUN` characters (never cutting an added or special token's text): the result is exactly the
tokenizer's own for any text without a whitespace-free run longer than `MAX_RUN`, and for longer
runs it differs only at the slice boundaries (still decoding to the same text).

A piece of text handed over on its own is tokenized as if it began the text. SentencePiece
tokenizers (Llama, Mistral's 32k vocabulary) then add their dummy prefix ("▁", a space) to it,
which they add only at the very start of a whole text (Metaspace `prepend_scheme="first"`). So a
piece that continues a text (a slice of a long run, or the text after an untrusted control token's
text is cut apart) is handed over behind an added token (`_sentinel`) whose id is dropped: the
tokenizer splits at added tokens itself, so the piece gets no prefix there. (Tokenizers that prefix
every text between added tokens, a legacy `Prepend` normalizer or prepend_scheme "always", still
give one at such a cut; the text between the template's own control tokens is never cut.)
"""

from __future__ import annotations

import bisect
import functools
import logging
import re
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..errors import EngineError

logger = logging.getLogger(__name__)

MAX_RUN = 1024
"""Longest whitespace-free run handed to the tokenizer at once (characters)."""

_LONG_RUN = re.compile(rf"\S{{{MAX_RUN + 1},}}")

Token = tuple[str, int]  # an added token's text and id


def encode(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False)`, in linear time (module docstring)."""
    pieces = split_long_runs(text, _protected(tokenizer))
    if len(pieces) == 1:
        return list(tokenizer.encode(text, add_special_tokens=False))
    return [token for ids in _encode_pieces(tokenizer, pieces) for token in ids]


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


def added_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """A regex of the tokenizer's added-token texts that finds, like the tokenizer, the longest one
    at the leftmost position; None when it has none. Built as a trie (`_trie_regex`): a flat
    alternation of Tekken's 1000 control tokens tried every one at each "<" (300 kB of "<" took
    14 s); the trie tries one branch per distinct next character."""
    tokens = added_tokens(tokenizer)
    return _compile(tuple(sorted(tokens))) if tokens else None


@functools.lru_cache(maxsize=32)
def _compile(tokens: tuple[str, ...]) -> re.Pattern[str]:
    trie: dict[str, dict] = {}
    for token in tokens:
        node = trie
        for char in token:
            node = node.setdefault(char, {})
        node[""] = {}  # a token ends here
    try:
        return re.compile(_trie_regex(trie))
    except RecursionError:  # a pathological nesting of tokens: the flat alternation, longest first
        return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True))))


def _trie_regex(node: dict[str, dict]) -> str:
    """The regex of the token suffixes below trie `node`, preferring a longer one (greedy `?`)."""
    branches = []
    for char in sorted(k for k in node if k):
        text, child = char, node[char]
        while len(child) == 1 and "" not in child:  # a chain without a branch: one literal
            ((char, child),) = child.items()
            text += char
        branches.append(re.escape(text) + (_trie_regex(child) if len(child) > ("" in child) else ""))
    body = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
    return f"(?:{body})?" if "" in node else body


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """Token ids of untrusted `text` in which no added/special token string becomes its control id:
    `encode_segments` with the whole text untrusted. Text without such strings gets exactly the
    tokenizer's own ids."""
    return encode_segments(tokenizer, text, [(0, len(text))])


def encode_segments(tokenizer: Any, text: str, untrusted: Sequence[tuple[int, int]]) -> list[int]:
    """Ids of rendered chat `text` where only added tokens outside the `untrusted` [start, end)
    spans become control ids. An added token's text that overlaps a span is cut after its first
    character, and the text is tokenized in the runs between such cuts (`_runs`): the tokenizer
    itself matches the control tokens in a run, and the text around them gets the ids it gets in
    the whole text. So for text whose untrusted spans hold no added-token string this is exactly
    `tokenizer(text, add_special_tokens=False)` (runs over MAX_RUN aside).

    Linear in the text and the spans: the spans are merged and sorted once and each match finds
    its span by bisection (a test of every match against every span was quadratic: 10,000 one-word
    messages took minutes). EngineError if the tokenizer still makes a control token of untrusted
    text (an added token matched after its normalizer rewrote the text): fail closed."""
    pattern = added_pattern(tokenizer)
    if pattern is None:
        return encode(tokenizer, text)
    protected = _protected(tokenizer)
    runs = _runs(pattern, text, _disjoint(untrusted))
    pieces = [piece for a, b in runs for piece in split_long_runs(text[a:b], protected)]
    ids = _encode_pieces(tokenizer, pieces)
    _check_controls(pattern, _added_vocab(tokenizer), pieces, ids)
    return [token for piece_ids in ids for token in piece_ids]


def _disjoint(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """`spans` sorted, overlapping or touching ones merged (a match overlaps the result's spans
    exactly when it overlaps the given ones)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _runs(pattern: re.Pattern[str], text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The [start, end) runs of `text`, in order, between cuts after the first character of each
    added-token string that overlaps one of the disjoint sorted `spans`. A run that starts at a cut
    is searched again: the tokenizer reads it from there, where a token hidden by the cut one's
    overlap can now match."""
    starts, ends = [a for a, _ in spans], [b for _, b in spans]
    runs: list[tuple[int, int]] = []
    todo = [(0, len(text))]
    while todo:
        a, b = todo.pop()
        cuts = []
        for match in pattern.finditer(text, a, b):
            j = bisect.bisect_right(ends, match.start())  # the first span that ends after it starts
            if j < len(spans) and starts[j] < match.end():
                cuts.append(match.start() + 1)
        if not cuts:
            runs.append((a, b))
            continue
        runs.append((a, cuts[0]))  # its matches are the tokenizer's own: it reads from `a` too
        bounds = [*cuts, b]
        todo += reversed(list(zip(bounds, bounds[1:], strict=False)))  # leftmost first
    return runs


def defuse(pattern: re.Pattern[str], text: str) -> list[str]:
    """`text` cut after the first character of every added-token string in it, again in the pieces
    (a token hidden by an overlapping match), until no piece holds one. "".join(result) == text."""
    return [text[a:b] for a, b in _runs(pattern, text, [(0, len(text))])]


def _encode_pieces(tokenizer: Any, pieces: list[str]) -> list[list[int]]:
    """The ids of each of the consecutive `pieces` of one text, in one tokenizer call. A piece that
    continues the text is handed over behind an added token (`_sentinel`), whose id is dropped, so
    that it gets no dummy prefix where the whole text would have none (module docstring)."""
    sentinel = _sentinel(tokenizer) if len(pieces) > 1 else None
    texts = [f"{sentinel[0]}{piece}" if sentinel and i else piece for i, piece in enumerate(pieces)]
    batch = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    out: list[list[int]] = []
    for i, (piece, ids) in enumerate(zip(pieces, batch, strict=True)):
        ids = list(ids)
        if sentinel and i:
            if ids[:1] == [sentinel[1]]:
                ids = ids[1:]
            else:  # the sentinel merged into a longer token: the piece alone is the best guess
                logger.debug("sentinel %r not kept before %r", sentinel[0], piece[:40])
                ids = list(tokenizer.encode(piece, add_special_tokens=False))
        out.append(ids)
    return out


def _check_controls(
    pattern: re.Pattern[str], vocab: dict[str, int], pieces: list[str], ids: list[list[int]]
) -> None:
    """EngineError if a piece's ids hold a control id that no added-token string of its own text
    (all trusted by then) accounts for."""
    controls = set(vocab.values())
    for piece, piece_ids in zip(pieces, ids, strict=True):
        found = Counter(token for token in piece_ids if token in controls)
        if found and found - Counter(vocab[m.group()] for m in pattern.finditer(piece)):
            raise EngineError(
                "the tokenizer makes a control token of untrusted text (an added token its "
                f"normalizer forms): refusing to encode {piece[:60]!r}"
            )


_LONGEST: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for: its vocabulary string's length is an
    upper bound (byte-level and byte-fallback spellings are never shorter than the text). Kept per
    tokenizer while its vocabulary size is the same."""
    size = len(tokenizer)
    if tokenizer not in _LONGEST or _LONGEST[tokenizer][0] != size:
        _LONGEST[tokenizer] = (size, max(1, max(map(len, tokenizer.get_vocab()), default=1)))
    return _LONGEST[tokenizer][1]


def _sentinel(tokenizer: Any) -> Token | None:
    """An added token that the tokenizer matches wherever it stands and that leaves its neighbours'
    text alone: not normalized, no lstrip/rstrip, not single-word (the first such by id); else
    any; None when the tokenizer has no added token."""
    vocab = _added_vocab(tokenizer)
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    quirky = set()
    for added in decoder.values() if isinstance(decoder, dict) else ():
        if any(getattr(added, flag, False) for flag in ("normalized", "lstrip", "rstrip", "single_word")):
            quirky.add(str(getattr(added, "content", added)))
    if not vocab:
        return None
    return min(vocab.items(), key=lambda item: (item[0] in quirky, item[1]))
