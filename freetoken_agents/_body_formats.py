"""The formats a constrained value takes (`constrained.py`): a JSON value, or Qwen3-Coder's
`<parameter=P>` tags around JSON or raw-text values, ending with `</function>` (its grammar:
`xml_structural_tag`). For each, just enough lexing for the closing policy to know where the value
stands: is it finished, and which tokens would close what is open (`JsonLexer`, `XmlParamsLexer`).

A lexer is fed the bytes of each token the grammar accepted, is copied for a simulation, and
answers `closed` (nothing may follow) and `closers(vocab)`: token-score tables [V] (-inf: not a
closer) to try in order, the first that allows any token wins; the vocabulary's `progress` table
is the fallback after them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .parsers.qwen3_coder import FUNCTION_END, PARAMETER, PARAMETER_END, VALUE_END, XmlParameter
from .schema_bounds import MAX_STRING_CHARS


class JsonLexer:
    """A JSON value: (in_string, escaped, depth, last structural byte), and `chars`: the
    characters written so far in the open string (escapes count as written; the decoder closes a
    string that runs too long: `ConstrainedDecode`)."""

    __slots__ = ("chars", "depth", "escaped", "in_string", "last")

    def __init__(self) -> None:
        self.in_string, self.escaped, self.depth, self.last, self.chars = False, False, 0, 0, 0

    def copy(self) -> JsonLexer:
        twin = JsonLexer()
        twin.in_string, twin.escaped, twin.depth, twin.last, twin.chars = (
            self.in_string,
            self.escaped,
            self.depth,
            self.last,
            self.chars,
        )
        return twin

    def feed(self, piece: bytes) -> None:
        for c in piece:
            self.feed_byte(c)

    def feed_byte(self, c: int) -> None:
        if self.in_string:
            if not 0x80 <= c < 0xC0:  # a UTF-8 continuation byte is part of the same character
                self.chars += 1
            if self.escaped:
                self.escaped = False
            elif c == 0x5C:  # backslash
                self.escaped = True
            elif c == 0x22:  # quote
                self.in_string, self.last = False, c
        elif c == 0x22:
            self.in_string, self.chars = True, 0
        elif c in b"{[":
            self.depth += 1
        elif c in b"}]":
            self.depth, self.last = self.depth - 1, c
        elif c not in b" \n\t\r":
            self.last = c

    @property
    def closed(self) -> bool:
        """The top-level value has ended with a quote or a bracket (nothing may follow it)."""
        return not self.in_string and self.depth == 0 and self.last in (0x22, 0x5D, 0x7D)

    @property
    def string_chars(self) -> int:
        """Characters written in the open string (0 outside a string)."""
        return self.chars if self.in_string else 0

    def closers(self, vocab: Any) -> tuple[torch.Tensor, ...]:
        return (vocab.string_close if self.in_string else vocab.bracket_close,)


_VALUE_END = VALUE_END.encode()  # b"\n</parameter>\n"
_FUNCTION_END = FUNCTION_END.encode()
_PARAMETER = PARAMETER.encode()


class XmlParamsLexer:
    """Qwen3-Coder's parameters (`qwen3_coder.xml_parameters`): between tags ("tags"), in a raw-text
    value ("raw", up to `\\n</parameter>`) or in a JSON value ("json", up to its first newline: a
    JSON value in the grammar's compact form has none). `raw_names`: the parameters written as text;
    `required`: the required ones, in order. Closers: the rest of the marker that closes what is
    open (`\\n</parameter>\\n` after a value; between tags the next required parameter's tag,
    or `</function>` when none is left), then a JSON value's own."""

    __slots__ = ("json", "mode", "raw_names", "required", "tail", "written")

    def __init__(self, raw_names: frozenset[bytes], required: tuple[bytes, ...] = ()) -> None:
        self.raw_names, self.required = raw_names, required
        self.mode = "tags"
        self.tail = b""  # tags: the text since the last "<"; raw: its last bytes (the end marker's)
        self.json: JsonLexer | None = None
        self.written = 0  # required parameters begun so far (the grammar keeps the schema's order)

    def copy(self) -> XmlParamsLexer:
        twin = XmlParamsLexer(self.raw_names, self.required)
        twin.mode, twin.tail, twin.written = self.mode, self.tail, self.written
        twin.json = self.json.copy() if self.json is not None else None
        return twin

    def feed(self, piece: bytes) -> None:
        for c in piece:
            if self.mode == "json":
                if c == 0x0A:  # the value's end: "\n</parameter>\n" follows
                    self.mode, self.tail, self.json = "tags", b"\n", None
                else:
                    assert self.json is not None
                    self.json.feed_byte(c)
            elif self.mode == "raw":
                self.tail = (self.tail + bytes((c,)))[-len(_VALUE_END) :]
                if self.tail.endswith(_VALUE_END[:-1]):  # "\n</parameter>": the value has ended
                    self.mode, self.tail = "tags", b""
            else:
                self.tail = b"<" if c == 0x3C else self.tail + bytes((c,))
                if self.tail.startswith(_PARAMETER) and self.tail.endswith(b">\n"):
                    name = self.tail[len(_PARAMETER) : -2]
                    if name in self.required:
                        self.written = self.required.index(name) + 1
                    self.mode, self.tail = ("raw", b"") if name in self.raw_names else ("json", b"")
                    self.json = JsonLexer() if self.mode == "json" else None

    @property
    def closed(self) -> bool:
        return self.mode == "tags" and self.tail == _FUNCTION_END

    @property
    def string_chars(self) -> int:
        """Characters of the open string of a JSON value (a raw-text value is bounded by its
        grammar: `_raw_text`)."""
        return self.json.string_chars if self.mode == "json" and self.json is not None else 0

    def closers(self, vocab: Any) -> tuple[torch.Tensor, ...]:
        if self.mode == "raw":
            return (vocab.prefix_closers(_rest(self.tail, _VALUE_END)),)
        if self.mode == "json":
            assert self.json is not None
            return (vocab.prefix_closers(_VALUE_END), *self.json.closers(vocab))
        if self.written < len(self.required):  # an optional parameter costs more than none
            target = _PARAMETER + self.required[self.written] + b">\n"
        else:
            target = _FUNCTION_END
        return (vocab.prefix_closers(_rest(self.tail, target)),)


def xml_structural_tag(
    params: list[XmlParameter], json_ebnf: Callable[[dict[str, Any]], str]
) -> dict[str, Any]:
    """xgrammar's structural tag (its JSON form) for Qwen3-Coder's parameters `params`: each
    `<parameter=P>\\n` VALUE `\\n</parameter>\\n` in order, optional ones optional, then
    `</function>`; a JSON value's grammar is `json_ebnf(schema)` (EBNF text)."""
    elements: list[dict[str, Any]] = []
    for p in params:
        if p.raw:
            content = _raw_text(p.schema)
        else:
            content = {"type": "grammar", "grammar": json_ebnf(p.schema)}
        tag = {"type": "tag", "begin": f"{PARAMETER}{p.name}>\n", "content": content, "end": VALUE_END}
        elements.append(tag if p.required else {"type": "optional", "content": tag})
    elements.append({"type": "const_string", "value": FUNCTION_END})
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}


def _raw_text(schema: dict[str, Any]) -> dict[str, Any]:
    """A raw-text value: one of a string enum, a string pattern, else any text up to maxLength
    (MAX_STRING_CHARS when the schema sets none: a value ends, `schema_bounds`)."""
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else None
    if values is None and "const" in schema:
        values = [schema["const"]]
    if values and all(isinstance(v, str) and v for v in values):
        return {"type": "or", "elements": [{"type": "const_string", "value": v} for v in values]}
    if schema.get("type") == "string" and isinstance(schema.get("pattern"), str):
        return {"type": "regex", "pattern": schema["pattern"]}
    text: dict[str, Any] = {"type": "any_text", "excludes": [PARAMETER_END], "max_chars": MAX_STRING_CHARS}
    if isinstance(schema.get("maxLength"), int) and schema["maxLength"] >= 0:
        text["max_chars"] = schema["maxLength"]
    elif isinstance(schema.get("minLength"), int):  # a text the schema wants longer is not cut short
        text["max_chars"] = max(MAX_STRING_CHARS, schema["minLength"])
    return text


def _rest(text: bytes, marker: bytes) -> bytes:
    """What is left of `marker` after the longest prefix of it that `text` ends with."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return marker[k:]
    return marker
