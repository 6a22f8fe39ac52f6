"""Grounded arguments: an opt-in constraint under which every free-text string argument of a tool
call is a span of the conversation's text (the user's and the tools' messages).

A small model that picked the right tool still misspells what it copies ("Osaka" -> "Oseke"); a
string value the user or a tool wrote is almost always a span of their text, so decoding only
tokens that keep the value a span turns a spelling problem into choosing where a span starts and
ends (at word boundaries: an argument copies whole words). It applies inside JSON string values
whose schema is a plain string (no enum, const, pattern or format: those the grammar already
constrains), found by their key path, and never to keys or the tool's name. Where no token the
grammar allows keeps the value a span (the value is not in the text), the step falls back to the
grammar alone.

Values are compared as the model writes them, JSON-escaped bytes, in both escapings (non-ASCII
raw and as `\\uXXXX`), so an escape sequence is copied as a whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import torch

Path = tuple[bytes, ...]
_ANY_ITEM = b"*"  # an array's element in a key path


def conversation_sources(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The texts arguments may be taken from: the user's and the tools' messages (their text parts)."""
    out: list[str] = []
    for message in messages:
        if message.get("role") not in ("user", "tool"):
            continue
        content = message.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            parts = [part for part in content if isinstance(part, dict)]
            out += [part["text"] for part in parts if isinstance(part.get("text"), str)]
    return out


def plain_string_paths(schema: Any) -> frozenset[Path]:
    """Key paths (JSON-escaped keys; `*` for an array element) of the plain string values `schema`
    allows, over every branch of anyOf / oneOf / allOf."""
    found: set[Path] = set()
    _walk(schema, (), found, depth=0)
    return frozenset(found)


def _walk(schema: Any, path: Path, found: set[Path], depth: int) -> None:
    if not isinstance(schema, dict) or depth > 32:
        return
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key, []) or []:
            _walk(branch, path, found, depth + 1)
    types = schema.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if "string" in types and not {"enum", "const", "pattern", "format"} & schema.keys():
        found.add(path)
    for name, sub in (schema.get("properties") or {}).items():
        _walk(sub, (*path, _escaped(name)), found, depth + 1)
    if isinstance(schema.get("items"), dict):
        _walk(schema["items"], (*path, _ANY_ITEM), found, depth + 1)


def _escaped(text: str, ascii_only: bool = False) -> bytes:
    return json.dumps(text, ensure_ascii=ascii_only)[1:-1].encode()


class SpanIndex:
    """The pieces of one vocabulary by the string content they write: the bytes before their first
    unescaped quote. `continuing[c]`: pieces that write `c` and leave the string open;
    `closing[c]`: pieces that write `c` and close it (`Osaka"}` -> `Osaka`). Built once per vocabulary."""

    def __init__(self, pieces: Sequence[bytes], skip: Iterable[int]) -> None:
        skipped = set(skip)
        self.continuing: dict[bytes, list[int]] = {}
        self.closing: dict[bytes, list[int]] = {}
        for i, piece in enumerate(pieces):
            if piece and i not in skipped:
                content = _content(piece)
                table = self.continuing if content == piece else self.closing
                table.setdefault(content, []).append(i)
        self.longest = max((len(c) for c in [*self.continuing, *self.closing]), default=0)


def _content(piece: bytes) -> bytes:
    escaped = False
    for k, c in enumerate(piece):
        if escaped:
            escaped = False
        elif c == 0x5C:
            escaped = True
        elif c == 0x22:
            return piece[:k]
    return piece


def _word_byte(c: int) -> bool:
    return c < 0x80 and (chr(c).isalnum() or c == 0x5F)


class _Source:
    """One source text (escaped bytes) and where a value may start and end in it: at word
    boundaries (an argument copies whole words, "Osaka", not "saka" or "Os"), never inside a
    UTF-8 character; every character of a non-ASCII script is a word of its own."""

    def __init__(self, text: bytes) -> None:
        self.text = text
        cuts = [
            k == 0
            or k == len(text)
            or (not (_word_byte(text[k - 1]) and _word_byte(text[k])) and not 0x80 <= text[k] < 0xC0)
            for k in range(len(text) + 1)
        ]
        self.cuts = cuts


class SpanGrounding:
    """Follows a JSON value as it is written and, inside a grounded string, masks the tokens that
    would make it something no source contains. `feed` every accepted piece; `restrict_` the
    (grammar-masked) logits before sampling."""

    def __init__(self, index: SpanIndex, sources: Sequence[str], paths: frozenset[Path]) -> None:
        self.index, self.paths = index, paths
        texts = {_escaped(s, ascii_only) for s in sources if s for ascii_only in (False, True)}
        self.sources = [_Source(t) for t in sorted(texts)]
        self.stack: list[list[Any]] = []  # [kind, key, expecting a key] per open container
        self.in_string = self.escaped = self.is_key = False
        self.value = b""  # the open string's bytes as written

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
        elif c == 0x22:
            top = self.stack[-1] if self.stack else None
            self.in_string, self.value = True, b""
            self.is_key = top is not None and top[0] == "object" and top[2]
        elif c == 0x7B:  # {
            self.stack.append(["object", b"", True])
        elif c == 0x5B:  # [
            self.stack.append(["array", _ANY_ITEM, False])
        elif c in (0x7D, 0x5D):  # } ]
            if self.stack:
                self.stack.pop()
        elif c == 0x2C and self.stack and self.stack[-1][0] == "object":  # ,
            self.stack[-1][2] = True

    @property
    def grounded(self) -> bool:
        """Inside a string value whose key path is a plain string's."""
        if not self.in_string or self.is_key or self.escaped:
            return False
        return tuple(frame[1] for frame in self.stack) in self.paths

    # ---- masking ---------------------------------------------------------------------------------
    def allowed(self) -> set[int]:
        """Token ids that keep the open value a span of a source from a word boundary on, and close
        it only where a word ends (an empty value may close at once)."""
        index, value = self.index, self.value
        ids: set[int] = set(index.closing.get(b"", ())) if not value else set()
        for source in self.sources:
            text, cuts = source.text, source.cuts
            start = text.find(value)
            while start >= 0:
                if cuts[start]:
                    after = start + len(value)
                    if value and cuts[after]:
                        ids.update(index.closing.get(b"", ()))
                    for end in range(after + 1, min(len(text), after + index.longest) + 1):
                        written = text[after:end]
                        ids.update(index.continuing.get(written, ()))
                        if cuts[end]:
                            ids.update(index.closing.get(written, ()))
                start = text.find(value, start + 1)
        return ids

    def restrict_(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask logits [V] (already grammar-masked) to tokens that keep a grounded value a span;
        unchanged outside one, or when no token the grammar allows would."""
        if not self.grounded or not self.sources:
            return logits
        flat = logits.view(-1)
        keep = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
        ids = [i for i in self.allowed() if i < flat.numel()]
        if not ids:
            return logits
        keep[torch.tensor(ids, device=flat.device)] = True
        if not bool(torch.isfinite(flat[keep]).any()):
            return logits  # the schema's value is not in the text: the grammar decides alone
        flat.masked_fill_(~keep, float("-inf"))
        return logits
