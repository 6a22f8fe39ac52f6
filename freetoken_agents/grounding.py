"""Grounded arguments: an opt-in constraint under which every free-text string argument of a tool
call is a span of the conversation's text (the user's and the tools' messages), and every number
argument a number written there.

A small model that picked the right tool still misspells what it copies ("Osaka" -> "Oseke"); a
string value the user or a tool wrote is almost always a span of their text, so decoding only
tokens that keep the value a span turns a spelling problem into choosing where a span starts and
ends (at word boundaries: an argument copies whole words). It applies inside JSON string values
whose schema is a plain string (no enum, const, pattern or format: those the grammar already
constrains), found by their key path, and never to keys or the tool's name. A value the text
quotes is copied whole. Where no token the grammar allows keeps the value a span (the value is not
in the text), the step falls back to the grammar alone. Numbers (integer or number fields) are
spans of a number in the text the same way ("372" may give 372 or 37, never 272). A string enum
whose values the text mentions (whole words, case aside: "in km" for ["km", "miles"]) takes one of
those; where it mentions none, the grammar chooses among all.

Values are compared as the model writes them, JSON-escaped bytes, in both escapings (non-ASCII
raw and as `\\uXXXX`), so an escape sequence is copied as a whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import torch

Path = tuple[bytes, ...]
_ANY_ITEM = b"*"  # an array's element in a key path


def conversation_sources(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The texts arguments may be taken from: the user's and the tools' messages (their text parts)."""
    return message_texts(messages, ("user", "tool"))


def message_texts(messages: Sequence[dict[str, Any]], roles: Collection[str]) -> list[str]:
    """The text of the messages whose role is one of `roles` (a string content, or its text parts)."""
    out: list[str] = []
    for message in messages:
        if message.get("role") not in roles:
            continue
        content = message.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            parts = [part for part in content if isinstance(part, dict)]
            out += [part["text"] for part in parts if isinstance(part.get("text"), str)]
    return out


def schema_paths(schema: Any) -> tuple[frozenset[Path], frozenset[Path], dict[Path, frozenset[str]]]:
    """Key paths (JSON-escaped keys; `*` for an array element) of the plain string values, of the
    number values and of the string enums (with their values) `schema` allows, over every branch
    of anyOf / oneOf / allOf: (strings, numbers, enums), in one walk."""
    strings: set[Path] = set()
    numbers: set[Path] = set()
    enums: dict[Path, set[str]] = {}
    _walk(schema, (), strings, numbers, enums, depth=0)
    return frozenset(strings), frozenset(numbers), {path: frozenset(v) for path, v in enums.items()}


def _mentioned(value: str, sources: Sequence[str]) -> bool:
    """Whether `value` is written in a source as a whole word (case aside)."""
    pattern = re.compile(rf"(?<!\w){re.escape(value)}(?!\w)", re.IGNORECASE)
    return any(pattern.search(text) for text in sources)


def _walk(
    schema: Any, path: Path, strings: set[Path], numbers: set[Path], enums: dict[Path, set[str]], depth: int
) -> None:
    if not isinstance(schema, dict) or depth > 32:
        return
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key, []) or []:
            _walk(branch, path, strings, numbers, enums, depth + 1)
    types = schema.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if not {"enum", "const"} & schema.keys():
        if "string" in types and not {"pattern", "format"} & schema.keys():
            strings.add(path)
        if {"integer", "number"} & types:
            numbers.add(path)
    values = [v for v in schema.get("enum") or () if isinstance(v, str)]
    if values:
        enums.setdefault(path, set()).update(values)
    for name, sub in (schema.get("properties") or {}).items():
        _walk(sub, (*path, _escaped(name)), strings, numbers, enums, depth + 1)
    if isinstance(schema.get("items"), dict):
        _walk(schema["items"], (*path, _ANY_ITEM), strings, numbers, enums, depth + 1)


def _escaped(text: str, ascii_only: bool = False) -> bytes:
    return json.dumps(text, ensure_ascii=ascii_only)[1:-1].encode()


_NUMBER_BYTES = frozenset(b"-+.0123456789eE")
_DIGITS = frozenset(b"0123456789")


def _string_content(piece: bytes) -> tuple[bytes, bool]:
    """(the bytes a piece writes inside an open string, whether it then closes the string)."""
    escaped = False
    for k, c in enumerate(piece):
        if escaped:
            escaped = False
        elif c == 0x5C:
            escaped = True
        elif c == 0x22:
            return piece[:k], True
    return piece, False


def _number_content(piece: bytes) -> tuple[bytes, bool]:
    """(the bytes a piece adds to a number, whether it then ends the number)."""
    for k, c in enumerate(piece):
        if c not in _NUMBER_BYTES:
            return piece[:k], True
    return piece, False


def _opening(piece: bytes) -> tuple[str, bytes]:
    """What a piece written where a value may start opens: ("string", what it writes after the
    opening quote), ("number", what it writes of the number) or ("other", b"": white space alone,
    a bracket, `null`...); white space before the value is dropped."""
    rest = piece.lstrip(b" \t\r\n")
    if rest[:1] == b'"':
        return "string", rest[1:]
    if rest[:1] and rest[0] in _NUMBER_BYTES:
        return "number", rest
    return "other", b""


def _string_opening(piece: bytes) -> tuple[bytes, bool] | None:
    kind, rest = _opening(piece)
    return _string_content(rest) if kind == "string" else None


def _number_opening(piece: bytes) -> tuple[bytes, bool] | None:
    kind, rest = _opening(piece)
    return _number_content(rest) if kind == "number" else None


class _Table:
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
        self.string = _Table(pieces, skipped, _string_content)
        self.number = _Table(pieces, skipped, _number_content)
        self.string_open = _Table(pieces, skipped, _string_opening)
        self.number_open = _Table(pieces, skipped, _number_opening)
        # Pieces that open neither (white space, brackets, literals): the grammar decides those.
        opening = self.string_open.ids | self.number_open.ids
        self.other = [i for i, p in enumerate(pieces) if p and i not in skipped and i not in opening]
        self._other_masks: dict[tuple[str, int], torch.Tensor] = {}

    def other_mask(self, size: int, device: torch.device) -> torch.Tensor:
        """`other` as a bool mask [size] on `device` (a large vocabulary's set, built once)."""
        key = (str(device), size)
        if key not in self._other_masks:
            mask = torch.zeros(size, dtype=torch.bool)
            mask[[i for i in self.other if i < size]] = True
            self._other_masks[key] = mask.to(device)
        return self._other_masks[key]


def _word_byte(c: int) -> bool:
    return c < 0x80 and (chr(c).isalnum() or c == 0x5F)


class _Source:
    """One source text (bytes) and where a value may start (`starts[k]`) and end (`ends[k]`) in it.

    Strings: at word boundaries (an argument copies whole words, "Osaka", not "saka" or "Os"),
    never inside a UTF-8 character, and neither starting nor ending with white space; every
    character of a non-ASCII script is a word of its own.
    A value the text quotes ('...', \"...\", curly or CJK quotes) is copied whole or not at
    all: a span starting at its first character ends at its closing quote, none starts or ends
    inside it ("Ursussol Labs", not "Ursussol"), and none that starts before it ends at its
    closing quote (not "called 'Ursussol Labs": an opening quote without its closing one).
    Numbers: a whole number or its leading digits ("71" of "71.0"), a sign included."""

    def __init__(self, text: bytes, number: bool = False) -> None:
        self.text = text
        self.only_end: dict[int, int] = {}  # a quoted value's start -> the one place it ends
        self.only_start: dict[int, int] = {}  # a quoted value's end -> where a span ending there starts
        positions = range(len(text) + 1)
        if number:
            self.starts = [_number_starts(text, k) for k in positions]
            self.ends = [_number_ends(text, k) for k in positions]
        else:
            cuts = [_word_cut(text, k) for k in positions]
            self.starts = [cut and k < len(text) and text[k] not in _SPACES for k, cut in enumerate(cuts)]
            self.ends = [cut and k > 0 and text[k - 1] not in _SPACES for k, cut in enumerate(cuts)]
            for first, end in _quoted(text):  # a quoted value is copied whole or not at all
                for k in range(first + 1, end):
                    self.starts[k] = False
                for k in range(first, end):
                    self.ends[k] = False
                self.starts[first] = self.ends[end] = True
                self.only_end[first] = end
                self.only_start[end] = first  # not "called 'X": an opening quote without its closing


# Quote pairs users delimit values with, as JSON-escaped bytes in both escapings (a double quote is
# written \", a curly or CJK quote raw or as \uXXXX).
_QUOTES = [(b"'", b"'"), (b'\\"', b'\\"')] + [
    (_escaped(a, ascii_only), _escaped(b, ascii_only))
    for a, b in ("\u201c\u201d", "\u2018\u2019", "\u300c\u300d", "\u300e\u300f")
    for ascii_only in (False, True)
]


def _quoted(text: bytes) -> list[tuple[int, int]]:
    """(first, end) of each non-empty quoted value in `text`: an opening quote not preceded by a
    word character and the next closing one not followed by one (so "don't" quotes nothing)."""
    out = []
    for opening, closing in _QUOTES:
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
                out.append((first, end))
            k = text.find(opening, end + len(closing))
    return out


_SPACES = frozenset(b" \t\r\n")


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


class SpanGrounding:
    """Follows a JSON value as it is written and, inside a grounded string or number, masks the
    tokens that would make it something no source contains. `feed` every accepted piece;
    `restrict_` the (grammar-masked) logits before sampling."""

    def __init__(
        self,
        index: SpanIndex,
        sources: Sequence[str],
        string_paths: frozenset[Path],
        number_paths: frozenset[Path] = frozenset(),
        enum_paths: Mapping[Path, Iterable[str]] | None = None,
    ) -> None:
        self.index, self.string_paths, self.number_paths = index, string_paths, number_paths
        # Enum values written in the conversation, per path: the value is one of them where any is.
        self.mentioned: dict[Path, list[bytes]] = {}
        for path, values in (enum_paths or {}).items():
            if said := [_escaped(v) for v in sorted(values) if _mentioned(v, sources)]:
                self.mentioned[path] = said
        texts = {_escaped(s, ascii_only) for s in sources if s for ascii_only in (False, True)}
        self.strings = [_Source(t) for t in sorted(texts)]
        self.numbers = [_Source(s.encode(), number=True) for s in sources if s]
        self.stack: list[list[Any]] = []  # [kind, key, expecting a key] per open container
        self.in_string = self.escaped = self.is_key = False
        self.expect_value = True  # a value may start here (top level, after ":", "[" or an array's ",")
        self.value = b""  # the open string's bytes as written
        self.number: bytes | None = None  # the number being written

    # ---- following the value ---------------------------------------------------------------------
    def feed(self, piece: bytes) -> None:
        for c in piece:
            self._feed_byte(c)

    def _feed_byte(self, c: int) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == 0x5C:
                self.escaped = True
            elif c == 0x22:
                self.in_string = False
                if self.is_key and self.stack:
                    self.stack[-1][1], self.stack[-1][2] = self.value, False
                return
            self.value += bytes((c,))
            return
        if self.number is not None:
            if c in _NUMBER_BYTES:
                self.number += bytes((c,))
                return
            self.number = None
        top = self.stack[-1] if self.stack else None
        if c in b" \n\t\r":
            return
        starts_value, self.expect_value = self.expect_value, False
        if c == 0x22:
            self.in_string, self.value = True, b""
            self.is_key = top is not None and top[0] == "object" and top[2]
        elif c in _NUMBER_BYTES and starts_value:
            self.number = bytes((c,))
        elif c == 0x7B:  # {
            self.stack.append(["object", b"", True])
        elif c == 0x5B:  # [
            self.stack.append(["array", _ANY_ITEM, False])
            self.expect_value = True
        elif c in (0x7D, 0x5D):  # } ]
            if self.stack:
                self.stack.pop()
        elif c == 0x3A:  # :
            self.expect_value = True
        elif c == 0x2C and top is not None:  # ,
            if top[0] == "object":
                top[2] = True
            else:
                self.expect_value = True

    @property
    def _path(self) -> Path:
        return tuple(frame[1] for frame in self.stack)

    @property
    def grounded(self) -> str | None:
        """ "string" inside a string value whose key path is a plain string's ("enum" a mentioned
        enum's), "number" inside a number value at a number's key path, "start" where such a value
        may start; else None."""
        if self.in_string:
            if self.is_key or self.escaped:
                return None
            path = self._path
            return "string" if path in self.string_paths else "enum" if path in self.mentioned else None
        path = self._path
        if self.number is not None:
            return "number" if path in self.number_paths else None
        if not self.expect_value:
            return None
        if path in self.string_paths or path in self.number_paths or path in self.mentioned:
            return "start"  # the next piece may open the value (` "Os`, ` -`)
        return None

    # ---- masking ---------------------------------------------------------------------------------
    def allowed(self, kind: str | None = None) -> set[int]:
        """Token ids that keep the open value a span of a source from a start on, and end it only
        where a span may end (an empty string may close at once). `kind`: `grounded`, when known."""
        kind = kind or self.grounded
        if kind == "string":
            return self._allowed(self.index.string, self.strings, self.value, empty_closes=True)
        if kind == "number":
            return self._allowed(self.index.number, self.numbers, self.number or b"", empty_closes=False)
        if kind == "enum":
            return self._allowed_enum(self.index.string, self.mentioned.get(self._path, ()), self.value)
        if kind == "start":
            return self._allowed_openers() | set(self.index.other)
        return set()

    def _allowed_openers(self) -> set[int]:
        """Where a value starts: the pieces that open a string or a number (white space before it
        aside) and keep it a span, or any such piece where the key path's value is not grounded."""
        index, path = self.index, self._path
        strings, numbers = index.string_open, index.number_open
        if path in self.string_paths or path in self.mentioned:
            ids = set(strings.continuing.get(b"", ()))  # a bare opening quote: nothing written yet
            if path in self.string_paths:
                ids |= self._allowed(strings, self.strings, b"", empty_closes=True)
            else:
                ids |= self._allowed_enum(strings, self.mentioned[path], b"")
        else:
            ids = set(strings.ids)
        if path in self.number_paths:
            ids |= self._allowed(numbers, self.numbers, b"", empty_closes=False)
        else:
            ids |= numbers.ids
        return ids

    @staticmethod
    def _allowed_enum(table: _Table, values: Sequence[bytes], value: bytes) -> set[int]:
        """Tokens that keep the open value a prefix of one of `values`, or end it on one."""
        ids: set[int] = set()
        for wanted in values:
            if not wanted.startswith(value):
                continue
            rest = wanted[len(value) :]
            if not rest:
                ids.update(table.closing.get(b"", ()))
            for n in range(1, min(len(rest), table.longest) + 1):
                ids.update(table.continuing.get(rest[:n], ()))
                if n == len(rest):
                    ids.update(table.closing.get(rest, ()))
        return ids

    @staticmethod
    def _allowed(table: _Table, sources: list[_Source], value: bytes, empty_closes: bool) -> set[int]:
        ids: set[int] = set(table.closing.get(b"", ())) if not value and empty_closes else set()
        for source in sources:
            text = source.text
            start = text.find(value)
            while start >= 0:
                after = start + len(value)
                last = source.only_end.get(start, len(text))  # a quoted value ends at its quote
                if source.starts[start] and after <= last:
                    ends_here = source.only_start.get
                    if value and source.ends[after] and ends_here(after, start) == start:
                        ids.update(table.closing.get(b"", ()))
                    for end in range(after + 1, min(last, after + table.longest) + 1):
                        written = text[after:end]
                        ids.update(table.continuing.get(written, ()))
                        if source.ends[end] and ends_here(end, start) == start:
                            ids.update(table.closing.get(written, ()))
                start = text.find(value, start + 1)
        return ids

    def restrict_(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask logits [V] (already grammar-masked) to tokens that keep a grounded value a span;
        unchanged outside one, or when no token the grammar allows would."""
        kind = self.grounded
        if kind is None:
            return logits
        flat = logits.view(-1)
        if kind == "start":  # the pieces that open no value as a mask: most of a large vocabulary
            keep = self.index.other_mask(flat.numel(), flat.device).clone()
            ids = [i for i in self._allowed_openers() if i < flat.numel()]
        else:
            keep = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
            ids = [i for i in self.allowed(kind) if i < flat.numel()]
            if not ids:
                return logits
        if ids:
            keep[torch.tensor(ids, device=flat.device)] = True
        if not bool(torch.isfinite(flat[keep]).any()):
            return logits  # the schema's value is not in the text: the grammar decides alone
        flat.masked_fill_(~keep, float("-inf"))
        return logits
