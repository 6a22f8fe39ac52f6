"""The two sides of a grounded argument (`grounding`): a vocabulary's pieces by what they write in a
JSON string or number (`SpanIndex`), and a source text with where a value may start and end in it
(`Source`: word boundaries, quoted values copied whole, the namings of parameters no span runs
into). Texts and pieces are compared as the model writes them, JSON-escaped bytes.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .named_values import FUNCTION_WORDS, GAP, name_matches, namings


def escaped(text: str, ascii_only: bool = False) -> bytes:
    return json.dumps(text, ensure_ascii=ascii_only)[1:-1].encode()


NUMBER_BYTES = frozenset(b"-+.0123456789eE")
_DIGITS = frozenset(b"0123456789")


def _string_content(piece: bytes) -> tuple[bytes, bool]:
    """(the bytes a piece writes inside an open string, whether it then closes the string)."""
    in_escape = False
    for k, c in enumerate(piece):
        if in_escape:
            in_escape = False
        elif c == 0x5C:
            in_escape = True
        elif c == 0x22:
            return piece[:k], True
    return piece, False


def _number_content(piece: bytes) -> tuple[bytes, bool]:
    """(the bytes a piece adds to a number, whether it then ends the number)."""
    for k, c in enumerate(piece):
        if c not in NUMBER_BYTES:
            return piece[:k], True
    return piece, False


def _opening(piece: bytes) -> tuple[str, bytes]:
    """What a piece written where a value may start opens: ("string", what it writes after the
    opening quote), ("number", what it writes of the number) or ("other", b"": white space alone,
    a bracket, `null`...); white space before the value is dropped."""
    rest = piece.lstrip(b" \t\r\n")
    if rest[:1] == b'"':
        return "string", rest[1:]
    if rest[:1] and rest[0] in NUMBER_BYTES:
        return "number", rest
    return "other", b""


def _string_opening(piece: bytes) -> tuple[bytes, bool] | None:
    kind, rest = _opening(piece)
    return _string_content(rest) if kind == "string" else None


def _number_opening(piece: bytes) -> tuple[bytes, bool] | None:
    kind, rest = _opening(piece)
    return _number_content(rest) if kind == "number" else None


class PieceTable:
    """Pieces by the content they write: `continuing[c]` leave the value open after `c`,
    `closing[c]` end it after `c` (`Osaka"}` -> `Osaka`; `3}` -> `3`). `split` gives a piece's
    (content, closes), or None for a piece the table leaves out."""

    def __init__(self, pieces: Sequence[bytes], skipped: set[int], split: Any) -> None:
        self.continuing: dict[bytes, list[int]] = {}
        self.closing: dict[bytes, list[int]] = {}
        self.ids: set[int] = set()  # every piece in the table
        for i, piece in enumerate(pieces):
            if piece and i not in skipped and (parts := split(piece)) is not None:
                content, closes = parts
                (self.closing if closes else self.continuing).setdefault(content, []).append(i)
                self.ids.add(i)
        self.longest = max((len(c) for c in [*self.continuing, *self.closing]), default=0)


class SpanIndex:
    """One vocabulary's pieces by what they write in a string and in a number, and, where a value
    starts, by what they open: a compact JSON grammar writes `": "` before a value, so a call whose
    prefix ends at the colon leaves the next piece to open the value (` -`, ` "Os`), and what it
    writes there must be a span too. Built once per vocabulary."""

    def __init__(self, pieces: Sequence[bytes], skip: Iterable[int]) -> None:
        skipped = set(skip)
        self.pieces = pieces
        # Pieces that may close an object, write a key's bytes or the comma before a key
        # (`SpanGrounding`'s keys: which an object writes).
        self.structural = [
            i for i, p in enumerate(pieces) if i not in skipped and (b"}" in p or b'"' in p or b"," in p)
        ]
        self.string = PieceTable(pieces, skipped, _string_content)
        self.number = PieceTable(pieces, skipped, _number_content)
        self.string_open = PieceTable(pieces, skipped, _string_opening)
        self.number_open = PieceTable(pieces, skipped, _number_opening)
        # Pieces that open neither (white space, brackets, literals): the grammar decides those.
        opening = self.string_open.ids | self.number_open.ids
        self.other = [i for i, p in enumerate(pieces) if p and i not in skipped and i not in opening]
        self._on_device: dict[tuple[object, ...], torch.Tensor] = {}  # built once per device
        # Pieces that open `true` or `false` (` t`, `false`, `true}`), for a boolean the text names.
        self.literal: dict[bytes, list[int]] = {b"true": [], b"false": []}
        for i in self.other:
            head = pieces[i].lstrip(b" \t\r\n")
            for word, ids in self.literal.items():
                if head and (word.startswith(head) or _ends_literal(head, word)):
                    ids.append(i)

    def structural_ids(self, size: int, device: torch.device, quoting: bool = False) -> torch.Tensor:
        """`structural` below `size` as an index tensor on `device` (built once per device);
        `quoting`: only those holding a quote (inside a string nothing else ends it)."""
        key = ("structural", str(device), size, quoting)
        if key not in self._on_device:
            ids = [i for i in self.structural if i < size and (not quoting or b'"' in self.pieces[i])]
            self._on_device[key] = torch.tensor(ids, dtype=torch.long).to(device)
        return self._on_device[key]

    def other_mask(self, size: int, device: torch.device) -> torch.Tensor:
        """`other` as a bool mask [size] on `device` (a large vocabulary's set, built once)."""
        key = (str(device), size)
        if key not in self._on_device:
            mask = torch.zeros(size, dtype=torch.bool)
            mask[[i for i in self.other if i < size]] = True
            self._on_device[key] = mask.to(device)
        return self._on_device[key]


def _ends_literal(head: bytes, word: bytes) -> bool:
    """Whether `head` writes `word` and then only what may follow a value (`true}`, `false,`)."""
    return head.startswith(word) and all(c in b",}] \t\r\n" for c in head[len(word) :])


TRUTH = {b"true": b"true", b"yes": b"true", b"on": b"true", b"1": b"true"}
TRUTH |= {b"false": b"false", b"no": b"false", b"off": b"false", b"0": b"false"}
TRUTH_WORD = re.compile(rb"(true|yes|on|1|false|no|off|0)(?![\w])", re.IGNORECASE)


_WORD_BYTES = frozenset(b"0123456789_ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_word_byte = _WORD_BYTES.__contains__  # an ASCII letter, digit or underscore (a set lookup: hot)


class Source:
    """One source text (bytes) and where a value may start (`starts[k]`) and end (`ends[k]`) in it.

    Strings: at word boundaries (an argument copies whole words, "Osaka", not "saka" or "Os"),
    never inside a UTF-8 character, and neither starting nor ending with white space; every
    character of a non-ASCII script is a word of its own.
    A value the text quotes ('...', \"...\", curly or CJK quotes) is copied whole or not at
    all: a span starting at its first character ends at its closing quote, none starts or ends
    inside it ("Ursussol Labs", not "Ursussol"), and none that starts before it runs into it
    (not "called 'Ursussol Labs"). An email address is copied whole too, and no span ends just
    after a comma, a colon, a semicolon, `!`, `?` or an opening bracket ("Gerbun," is "Gerbun").
    A name does not run on into the request's prose (`_name_ends`: "Ilpekrar for me"), and no
    span runs past the end of a sentence or takes its full stop (`_sentence_ends`).
    Numbers: a whole number or its leading digits ("71" of "71.0", for an integer), a sign included."""

    def __init__(self, text: bytes, number: bool = False) -> None:
        self.text, self.number = text, number
        self.only_end: dict[int, int] = {}  # a quoted value's start -> the one place it ends
        self.only_start: dict[int, int] = {}  # a quoted value's end -> where a span ending there starts
        self.walls: list[int] = []  # where no span runs into: a quoted value, a parameter's name
        self.addresses: frozenset[int] = frozenset()  # where an email address starts (strings)
        self.quoted = bytearray(len(text) + 1)  # 1 inside a quoted value (its quotes aside)
        positions = range(len(text) + 1)
        self.point_ends: frozenset[int] = frozenset()  # numbers: ends before a fraction ("66" of "66.7")
        if number:
            self.starts = [_number_starts(text, k) for k in positions]
            self.ends = [_number_ends(text, k) for k in positions]
            self.point_ends = frozenset(k for k in positions if self.ends[k] and _FRACTION.match(text, k))
        else:
            cuts = [_word_cut(text, k) for k in positions]
            self.starts = [cut and k < len(text) and text[k] not in _NO_START for k, cut in enumerate(cuts)]
            self.ends = [cut and k > 0 and text[k - 1] not in _NO_END for k, cut in enumerate(cuts)]
            for quote in _QUOTE_MARKS:  # a value starts after its quote
                k = text.find(quote)
                while k >= 0:
                    self.starts[k] = False
                    k = text.find(quote, k + 1)
            for match in LOWER_WORD.finditer(text):  # not "in notebook", "me", "with": no value
                if self.starts[match.start()] and match.group().decode() in FUNCTION_WORDS:
                    self.starts[match.start()] = False  # starts so ("The Hague" is capitalised)
            # Copied whole: a JSON escape (not "u201d" of "\u201d"), an address (not "banana91").
            emails = list(_EMAIL.finditer(text))
            self.addresses = frozenset(m.start() for m in emails)
            for match in (*_ESCAPE.finditer(text), *emails):
                for k in range(match.start() + 1, match.end()):
                    self.starts[k] = self.ends[k] = False
            for quote, first, end in _quoted(text):  # a quoted value is copied whole or not at all
                for k in range(first + 1, end):
                    self.starts[k] = False
                for k in range(first, end):
                    self.ends[k] = False
                self.starts[first] = self.ends[end] = True
                self.only_end[first] = end
                self.only_start[end] = first  # not "called 'X": an opening quote without its closing
                self.walls.append(_before_spaces(text, quote))  # nor "translate 'X' (": none runs into it
            for first, end in self.only_end.items():
                self.quoted[first:end] = b"\x01" * (end - first)
            # "Ilpekrar| for me", not "Ilpekrar for"; "UJF|. Please use a tool."; a quoted value
            # is copied whole all the same
            self.walls += [k for k in (*_name_ends(text), *_sentence_ends(text)) if not self.quoted[k]]
            self.walls.sort()
        # The first place at or after k where a span may end (past the text: none): a value is not
        # written on into a place it cannot end before a wall ("SZ," before "currency GBP").
        self.next_end = [len(text) + 1] * (len(text) + 2)
        for k in reversed(positions):
            self.next_end[k] = k if self.ends[k] else self.next_end[k + 1]

    def name_values(
        self, keys: Iterable[str], containers: Iterable[str] = ()
    ) -> tuple[dict[str, set[int]], dict[str, set[bytes]]]:
        """Where the text names a value of one of `keys` (`named_values.namings`), in one scan:
        (key -> where such values start (those a span may start at), key -> the literals, `true`
        or `false`, a truth word names it with: `public=False`, `high priority: off`). From a
        naming's first byte to its value no span starts, and none that starts before it runs into
        it; a naming inside a quoted value ('unit: x') starts and stops no span. A parameter's
        name written without a value (`mentions`) is a wall too, and starts no span. `containers`:
        the names of the objects holding parameters (`namings`)."""
        starts: dict[str, set[int]] = {}
        truths: dict[str, set[bytes]] = {}
        quoted = self.quoted
        for naming in namings(self.text, keys, [opening for opening, _ in QUOTES], containers):
            if said := TRUTH_WORD.match(self.text, naming.value):
                truths.setdefault(naming.key, set()).add(TRUTH[said.group(1).lower()])
            if quoted[naming.start]:
                continue
            for k in range(naming.start, naming.value):
                self.starts[k] = False
            self.walls.append(_before_spaces(self.text, naming.start))  # "Kitu| unit = km"
            if self.starts[naming.value]:
                starts.setdefault(naming.key, set()).add(naming.value)
        for key, at, end in name_matches(self.text, keys):  # named value or not: `currency GBP`
            if quoted[at]:
                continue
            self.walls.append(_before_spaces(self.text, at))  # "SZ| currency GBP": not "SZ, currency GBP"
            self.starts[at] = False  # nor "high priority no": a parameter's name is no value
            gap = GAP.match(self.text, end)  # "breakfast true": a boolean named by its bare name
            if gap and (said := TRUTH_WORD.match(self.text, gap.end())):
                truths.setdefault(key, set()).add(TRUTH[said.group(1).lower()])
        self.walls.sort()
        return starts, truths

    def last_end(self, start: int) -> int:
        """The furthest a span starting at `start` may end: its quoted value's closing quote, the
        next naming of a parameter, or the text's end."""
        last = self.only_end.get(start, len(self.text))
        wall = bisect.bisect_right(self.walls, start)
        return min(last, self.walls[wall]) if wall < len(self.walls) else last


# Quote pairs users delimit values with, as JSON-escaped bytes in both escapings (a double quote is
# written \", a curly or CJK quote raw or as \uXXXX).
QUOTES = [(b"'", b"'"), (b'\\"', b'\\"')] + [
    (escaped(a, ascii_only), escaped(b, ascii_only))
    for a, b in ("\u201c\u201d", "\u2018\u2019", "\u300c\u300d", "\u300e\u300f")
    for ascii_only in (False, True)
]

_QUOTE_MARKS = frozenset(q for pair in QUOTES for q in pair)


def _quoted(text: bytes) -> list[tuple[int, int, int]]:
    """(opening quote, first, end) of each non-empty quoted value in `text`: an opening quote not
    preceded by a word character and the next closing one not followed by one (so "don't" quotes
    nothing)."""
    out = []
    for opening, closing in QUOTES:
        k = text.find(opening)
        while k >= 0:
            first = k + len(opening)
            if k > 0 and _word_byte(text[k - 1]):
                k = text.find(opening, k + 1)
                continue
            end = text.find(closing, first)
            while end >= 0 and end + len(closing) < len(text) and _word_byte(text[end + len(closing)]):
                end = text.find(closing, end + 1)
            if end < 0:
                break
            if end > first:
                out.append((k, first, end))
            k = text.find(opening, end + len(closing))
    return out


_SPACES = frozenset(b" \t\r\n")
# A value ends at a word's end, never on white space, nor just after punctuation that closes a
# clause or opens a bracket ("Gerbun," and "SZ," are "Gerbun" and "SZ").
_NO_END = _SPACES | frozenset(b",;:!?([{")
_NO_START = _SPACES | frozenset(b",;:!?)]}")  # nor starts on what ends a clause or a bracket
_EMAIL = re.compile(rb"[\w.%+-]+@[\w-]+(?:\.[\w-]+)+")  # an email address
_ESCAPE = re.compile(rb"\\(?:u[0-9a-fA-F]{4}|.)")  # one JSON escape: \u201d, \", \n
LOWER_WORD = re.compile(rb"(?<![\w])[a-z]+(?![\w])")  # a word in lowercase ASCII letters
_FRACTION = re.compile(rb"\.[0-9]")  # a number's fraction after its whole part


_NAME_THEN_FUNCTION_WORD = re.compile(rb"(?<![\w])[A-Z][A-Za-z0-9]*(?=,?[ \t]+([a-z]+)(?![\w]))")
_NEXT_WORD = re.compile(rb",?[ \t]+([A-Za-z]+)")


def _name_ends(text: bytes) -> list[int]:
    """Where a name ends before the request's prose: after a capitalised word, a lowercase
    function word whose run of function words does not reach another capitalised word
    ("Ilpekrar| for me", "Kupintom| with nights 12", "Outhkarmair|, with"; not "Bank of America",
    "Lake of the Woods"). No span runs past such a place."""
    out: list[int] = []
    for match in _NAME_THEN_FUNCTION_WORD.finditer(text):
        if match.group(1).decode() not in FUNCTION_WORDS:
            continue
        k = match.end()
        while (word := _NEXT_WORD.match(text, k)) and word.group(1).decode() in FUNCTION_WORDS:
            k = word.end()
        if not (word and word.group(1)[:1].isupper()):
            out.append(match.end())
    return out


_SENTENCE_END = re.compile(rb"(?<=[\w])[.!?](?=\s|$)")
_WORD_BEFORE = re.compile(rb"[A-Za-z]+$")


def _sentence_ends(text: bytes) -> list[int]:
    """Where a sentence ends: a full stop, `!` or `?` after a word and before white space or the
    text's end, but not after an initial or a short capitalised abbreviation ("J.", "U.S.",
    "St.", "Inc."). No span runs past it, nor takes the stop: "UJF" of "UJF. Please use a tool.",
    "Saint Stakaiva" of "destination = Saint Stakaiva."."""
    out: list[int] = []
    for match in _SENTENCE_END.finditer(text):
        k = match.start()
        word = _WORD_BEFORE.search(text, max(0, k - 8), k)
        before = word.group() if word else b""
        short = before[:1].isupper() and len(before) <= 3 and (len(before) == 1 or before[1:].islower())
        if text[k] != 0x2E or not short:
            out.append(k)
    return out


def _before_spaces(text: bytes, k: int) -> int:
    """Where the white space right before `k` starts (`k` if none): `len(text[:k].rstrip())`
    without copying the text."""
    while k > 0 and text[k - 1] in _SPACES:
        k -= 1
    return k


def _word_cut(text: bytes, k: int) -> bool:
    if k in (0, len(text)):
        return True
    inside_word = _word_byte(text[k - 1]) and _word_byte(text[k])
    return not inside_word and not 0x80 <= text[k] < 0xC0  # not inside a UTF-8 character


def _number_starts(text: bytes, k: int) -> bool:
    n = len(text)
    if k == n or (k > 0 and text[k - 1] in _DIGITS | {0x2E, 0x2D}):
        return False
    return text[k] in _DIGITS or (text[k] == 0x2D and k + 1 < n and text[k + 1] in _DIGITS)


def _number_ends(text: bytes, k: int) -> bool:
    return k > 0 and text[k - 1] in _DIGITS and (k == len(text) or text[k] not in _DIGITS)
