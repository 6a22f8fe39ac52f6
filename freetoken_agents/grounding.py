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
spans of a number in the text the same way ("372" gives 372, never 272 or 37; a number field
takes "66.7" whole, an integer may take 71 of "71.0"). A string enum whose values the text
mentions (whole words, case aside: "in km" for ["km", "miles"]) takes one of those; where it
mentions none, the grammar chooses among all. A value the text names by its parameter (`unit =
km`, `ticker='LGNE'`, `duration minutes: 13`: `named_values`) starts where the text writes it, no
other value's span runs into that naming, and the call does not close without it.
What a value is not: a span starting on a lowercase word of the called tool's own name or
description ("stock" for "Get the stock price of JWFPH"), where another start fits; a name run on
into the request's prose ("Ilpekrar for" of "Ilpekrar for me") or past the end of a sentence
("UJF. Please use a tool.": `spans`). And a call writes no optional key the conversation never
mentions (`said_keys`).

Values are compared as the model writes them, JSON-escaped bytes, in both escapings (non-ASCII
raw and as `\\uXXXX`), so an escape sequence is copied as a whole.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from .named_values import key_words
from .said_keys import ANY_ITEM, ObjectKeys, Path, objects_of, unsaid_keys
from .spans import LOWER_WORD, NUMBER_BYTES, PieceTable, Source, SpanIndex, escaped

# Parameter names (in words, `key_words`) whose value is an email address: where the text writes
# one, such a string parameter's value is one the text writes (as if named: `unit = km`).
ADDRESS_KEYS = frozenset({"to", "recipient", "recipients", "email", "email address", "cc", "bcc"})


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


class SchemaPaths(NamedTuple):
    """Key paths (JSON-escaped keys; `*` for an array element) of the values a schema allows, by
    kind: plain strings, numbers, string enums (with their values) and booleans; `integers`: the
    numbers that may be integers (the others take a fraction the text writes whole)."""

    strings: frozenset[Path]
    numbers: frozenset[Path]
    enums: dict[Path, frozenset[str]]
    booleans: frozenset[Path]
    integers: frozenset[Path] = frozenset()


def schema_paths(schema: Any) -> SchemaPaths:
    """`SchemaPaths` of `schema`, over every branch of anyOf / oneOf / allOf, in one walk."""
    strings: set[Path] = set()
    numbers: set[Path] = set()
    enums: dict[Path, set[str]] = {}
    booleans: set[Path] = set()
    integers: set[Path] = set()
    _walk(schema, (), strings, numbers, enums, booleans, integers, depth=0)
    frozen = {path: frozenset(v) for path, v in enums.items()}
    return SchemaPaths(
        frozenset(strings), frozenset(numbers), frozen, frozenset(booleans), frozenset(integers)
    )


def _mentioned(value: str, sources: Sequence[str]) -> bool:
    """Whether `value` is written in a source as a whole word (case aside)."""
    pattern = re.compile(rf"(?<!\w){re.escape(value)}(?!\w)", re.IGNORECASE)
    return any(pattern.search(text) for text in sources)


def _call_tool(option: Any) -> tuple[str, str, dict[str, Any]] | None:
    """(tool name, arguments key, parameters schema) of one option of a call schema (`{"name":
    {"const": N}, K: parameters}`, as `name_args_schema` builds it); None for any other schema
    (a property "name" whose schema is `true` or no const included)."""
    props = option.get("properties") if isinstance(option, dict) else None
    if not isinstance(props, dict) or not isinstance(props.get("name"), dict):
        return None
    name = props["name"].get("const")
    rest = [(k, v) for k, v in props.items() if k != "name"]
    if not isinstance(name, str) or len(rest) != 1 or not isinstance(rest[0][1], dict):
        return None
    return name, rest[0][0], rest[0][1]


def _options(schema: Any) -> list[Any]:
    return schema.get("anyOf", [schema]) if isinstance(schema, dict) else []


def tool_key_paths(schema: Any) -> dict[bytes, frozenset[Path]]:
    """For a call schema of `{"name": <const>, ...}` objects (`name_args_schema`: one, or an
    anyOf of one per tool), each tool's name (JSON-escaped) -> every key path its values and the
    objects holding them take; {} for any other schema (every path is then the one schema's)."""
    out: dict[bytes, frozenset[Path]] = {}
    for option in _options(schema):
        if (call := _call_tool(option)) is None:
            return {}
        paths = schema_paths(option)
        every = {*paths.strings, *paths.numbers, *paths.enums, *paths.booleans}
        out[escaped(call[0])] = frozenset(path[:n] for path in every for n in range(1, len(path) + 1))
    return out


def sole_required_strings(schema: Any) -> dict[bytes | None, Path]:
    """Per tool of a call schema (`name_args_schema`; None for a schema that is no call), the key
    path of its one required plain string parameter (no enum, const, pattern or format), where it
    has exactly one: a title, a query, a text to translate. A tool with two (an origin and a
    destination, a channel and a message) has none here."""
    out: dict[bytes | None, Path] = {}
    for option in _options(schema):
        if not isinstance(option, dict):
            continue
        tool: bytes | None = None
        params, prefix = option, ()
        if (call := _call_tool(option)) is not None:
            tool, prefix, params = escaped(call[0]), (escaped(call[1]),), call[2]
        fields = params.get("properties") or {}
        strings = [k for k in params.get("required") or () if _plain_string(fields.get(k))]
        if len(strings) == 1:
            out[tool] = (*prefix, escaped(strings[0]))
    return out


def object_keys(schema: Any) -> dict[bytes | None, dict[Path, ObjectKeys]]:
    """Per tool of a call schema (None for a schema that is no call), per object's key path, its
    keys in order and the names that mention each optional one (`said_keys.objects_of`)."""
    out: dict[bytes | None, dict[Path, ObjectKeys]] = {}
    for option in _options(schema):
        call = _call_tool(option)
        out[escaped(call[0]) if call is not None else None] = objects_of(option)
    return out


def tool_texts(tools: Sequence[dict[str, Any]]) -> dict[bytes | None, str]:
    """Each tool's own words, its name and description, by its JSON-escaped name (a call schema's
    `name`), and under None where there is one tool (a body schema of its parameters alone). A
    tool that is no object with a string name adds no words (they are a hint, not a contract)."""
    out: dict[bytes | None, str] = {}
    for spec in tools:
        fn = spec.get("function", spec) if isinstance(spec, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            description = fn.get("description")
            text = fn["name"] + (" " + description if isinstance(description, str) else "")
            out[escaped(fn["name"])] = text
            if len(tools) == 1:
                out[None] = text
    return out


def _plain_string(schema: Any) -> bool:
    if not isinstance(schema, dict) or {"enum", "const", "pattern", "format"} & schema.keys():
        return False
    kind = schema.get("type")
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _written_at(text: bytes, start: int, value: bytes) -> bool:
    """Whether `text` writes `value` (case aside) as a whole word at `start`."""
    end = start + len(value)
    if text[start:end].lower() != value.lower():
        return False
    return end == len(text) or not (chr(text[end]).isalnum() or text[end] == 0x5F)


def _walk(
    schema: Any,
    path: Path,
    strings: set[Path],
    numbers: set[Path],
    enums: dict[Path, set[str]],
    booleans: set[Path],
    integers: set[Path],
    depth: int,
) -> None:
    if not isinstance(schema, dict) or depth > 32:
        return
    kinds = (strings, numbers, enums, booleans, integers)
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key, []) or []:
            _walk(branch, path, *kinds, depth + 1)
    types = schema.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if not {"enum", "const"} & schema.keys():
        if "string" in types and not {"pattern", "format"} & schema.keys():
            strings.add(path)
        if {"integer", "number"} & types:
            numbers.add(path)
        if "integer" in types:
            integers.add(path)
        if "boolean" in types:
            booleans.add(path)
    values = [v for v in schema.get("enum") or () if isinstance(v, str)]
    if values:
        enums.setdefault(path, set()).update(values)
    for name, sub in (schema.get("properties") or {}).items():
        _walk(sub, (*path, escaped(name)), *kinds, depth + 1)
    if isinstance(schema.get("items"), dict):
        _walk(schema["items"], (*path, ANY_ITEM), *kinds, depth + 1)


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
        boolean_paths: frozenset[Path] = frozenset(),
        integer_paths: frozenset[Path] | None = None,
        tool_paths: Mapping[bytes, frozenset[Path]] | None = None,
        sole_required: Mapping[bytes | None, Path] | None = None,
        objects: Mapping[bytes | None, Mapping[Path, ObjectKeys]] | None = None,
        tool_texts: Mapping[bytes | None, str] | None = None,
    ) -> None:
        self.index, self.string_paths, self.number_paths = index, string_paths, number_paths
        # A number that may not be an integer is written whole ("66.7", not "66"); None: any may.
        self.fractions = number_paths - integer_paths if integer_paths is not None else frozenset()
        # Each tool's key paths (`tool_key_paths`): a key the text names for one tool's parameter
        # is not asked of another tool's call (its schema has no such key).
        self.tool_paths = tool_paths or {}
        self.tool: bytes | None = None  # the tool's name, once the call writes it
        # Per tool (None: a schema that is no call), its one required plain string parameter.
        self.sole_required = sole_required or {}
        # Enum values written in the conversation, per path: the value is one of them where any is.
        self.mentioned: dict[Path, list[bytes]] = {}
        for path, values in (enum_paths or {}).items():
            if said := [escaped(v) for v in sorted(values) if _mentioned(v, sources)]:
                self.mentioned[path] = said
        texts = {escaped(s, ascii_only) for s in sources if s for ascii_only in (False, True)}
        self.strings = [Source(t) for t in sorted(texts)]
        self.numbers = [Source(s.encode(), number=True) for s in sources if s]
        # Values the text names by their parameter, per key path: source -> where they start; and
        # the booleans it names with a truth word, where it names each with one only.
        self.named: dict[Path, dict[Source, set[int]]] = {}
        # Per source, the values it names, start -> the keys naming it: no other key's value.
        claimed: dict[Source, dict[int, set[str]]] = {}
        by_key: dict[str, list[Path]] = {}
        for path in (*string_paths, *number_paths, *(enum_paths or {}), *boolean_paths):  # walls too
            if path and path[-1] != ANY_ITEM:
                by_key.setdefault(path[-1].decode("utf-8", "replace"), []).append(path)
        said: dict[str, set[bytes]] = {}
        # The objects holding parameters (`room` of `with room building pepper`), by name.
        containers = {
            key.decode("utf-8", "replace")
            for paths in by_key.values()
            for path in paths
            for key in path[:-1]
            if key != ANY_ITEM
        }
        address_keys = [key for key in by_key if key_words(key)[-1].lower() in ADDRESS_KEYS]
        for source in (*self.strings, *self.numbers):
            starts_by_key, truths = source.name_values(by_key, containers)
            for key, starts in starts_by_key.items():
                for path in by_key[key]:
                    self.named.setdefault(path, {})[source] = starts
                for start in starts:
                    claimed.setdefault(source, {}).setdefault(start, set()).add(key)
            if source.addresses:  # an address parameter takes an address the text writes
                for key in address_keys:
                    for path in by_key[key]:
                        if path in string_paths and source not in self.named.get(path, {}):
                            self.named.setdefault(path, {})[source] = set(source.addresses)
                    for start in source.addresses:
                        claimed.setdefault(source, {}).setdefault(start, set()).add(key)
            if not source.number:  # truth words as the model writes them: the escaped texts
                for key, words in truths.items():
                    said.setdefault(key, set()).update(words)
        # Per key path, the starts the text names for other parameters ("trimel to -33.3,
        # offset: 94": 94 is the offset's, not x's), once here rather than at every token.
        self.barred: dict[Path, dict[Source, set[int]]] = {
            path: {
                source: {start for start, keys in by_start.items() if key not in keys}
                for source, by_start in claimed.items()
            }
            for key, paths in by_key.items()
            for path in paths
        }
        # An array's items and a value at the top are no parameter's: every named start is barred.
        self.barred_to_all = {source: set(by_start) for source, by_start in claimed.items()}
        # An enum the text names (`source language english`) takes the value named, not any
        # value the text mentions ("translate to spanish, source language english").
        for path, said_values in list(self.mentioned.items()):
            by_source = self.named.get(path)
            if not by_source:
                continue
            at_naming = [
                v
                for v in said_values
                if any(_written_at(src.text, at, v) for src, starts in by_source.items() for at in starts)
            ]
            if at_naming:
                self.mentioned[path] = at_naming
        self.truths: dict[Path, bytes] = {}
        for key, words in said.items():
            for path in by_key[key]:
                if len(words) == 1 and path in boolean_paths and path not in string_paths | number_paths:
                    self.truths[path] = next(iter(words))
        # The one value the text quotes that no naming claims, where it quotes one only (the same
        # text counted once, in both escapings): the value of the tool's one required plain string
        # parameter, where it has one (`sole_required_strings`).
        quoted: dict[bytes, dict[Source, set[int]]] = {}
        for source in self.strings:
            for first, end in source.only_end.items():
                if first not in claimed.get(source, {}):
                    text = json.loads(b'"' + source.text[first:end] + b'"')
                    quoted.setdefault(text.encode(), {}).setdefault(source, set()).add(first)
        self.quoted = next(iter(quoted.values())) if len(quoted) == 1 else None
        # Per object's key path, the keys the text names a value under (`unit = km`, `public:
        # no`, and the keys leading to such a value): the object does not close without them.
        self.named_keys: dict[Path, frozenset[bytes]] = {}
        named_paths = [p for p, by in self.named.items() if any(by.values())] + list(self.truths)
        for path in named_paths:
            if ANY_ITEM not in path:
                for depth in range(len(path)):
                    keys = self.named_keys.get(path[:depth], frozenset())
                    self.named_keys[path[:depth]] = keys | {path[depth]}
        # Per tool, per source: where a word the tool's own name or description uses starts, written
        # in lowercase ("how often a letter appears in forest" for "Count how often a letter
        # appears in a word"): a value carries the request's words, not the tool's.
        self.own_words: dict[bytes | None, dict[Source, set[int]]] = {}
        for tool, text in (tool_texts or {}).items():
            words = set(re.findall(r"[a-z]+", text.replace("_", " ").lower()))
            self.own_words[tool] = {
                source: {m.start() for m in LOWER_WORD.finditer(source.text) if m.group().decode() in words}
                for source in self.strings
            }
        # Per tool, per object path: its keys in order, and the optional ones the conversation
        # does not mention (`said_keys`), which the call does not write.
        objects = objects or {}
        said_paths = {*self.mentioned, *self.truths, *(p for p, by in self.named.items() if any(by.values()))}
        self.unsaid = unsaid_keys(objects, sources, said_paths)
        self.key_order = {
            tool: {path: keys.order for path, keys in by.items()} for tool, by in objects.items()
        }
        # [kind, key, expecting a key, the keys written] per open container
        self.stack: list[list[Any]] = []
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
                    self.stack[-1][3].add(self.value)
                elif len(self.stack) == 1 and self.stack[0][1] == b"name":  # the call's tool
                    self.tool = self.value
                return
            self.value += bytes((c,))
            return
        if self.number is not None:
            if c in NUMBER_BYTES:
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
        elif c in NUMBER_BYTES and starts_value:
            self.number = bytes((c,))
        elif c == 0x7B:  # {
            self.stack.append(["object", b"", True, set()])
        elif c == 0x5B:  # [
            self.stack.append(["array", ANY_ITEM, False, set()])
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
        may start, "boolean" where a boolean the text names (`public=False`) starts; else None."""
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
        return "boolean" if path in self.truths else None

    # ---- masking ---------------------------------------------------------------------------------
    def allowed(self, kind: str | None = None) -> set[int]:
        """Token ids that keep the open value a span of a source from a start on, and end it only
        where a span may end (an empty string may close at once). `kind`: `grounded`, when known."""
        kind = kind or self.grounded
        if kind == "string":
            return self._spans(self.index.string, self.strings, self.value, empty_closes=True)
        if kind == "number":
            return self._spans(self.index.number, self.numbers, self.number or b"", empty_closes=False)
        if kind == "enum":
            return self._allowed_enum(self.index.string, self.mentioned.get(self._path, ()), self.value)
        if kind == "start":
            return self._allowed_openers() | set(self.index.other)
        if kind == "boolean":
            return set(self.index.literal[self.truths[self._path]])
        return set()

    def _allowed_openers(self) -> set[int]:
        """Where a value starts: the pieces that open a string or a number (white space before it
        aside) and keep it a span, or any such piece where the key path's value is not grounded."""
        index, path = self.index, self._path
        strings, numbers = index.string_open, index.number_open
        if path in self.string_paths or path in self.mentioned:
            ids = set(strings.continuing.get(b"", ()))  # a bare opening quote: nothing written yet
            if path in self.string_paths:
                ids |= self._spans(strings, self.strings, b"", empty_closes=True)
            else:
                ids |= self._allowed_enum(strings, self.mentioned[path], b"")
        else:
            ids = set(strings.ids)
        if path in self.number_paths:
            ids |= self._spans(numbers, self.numbers, b"", empty_closes=False)
        else:
            ids |= numbers.ids
        return ids

    @staticmethod
    def _allowed_enum(table: PieceTable, values: Sequence[bytes], value: bytes) -> set[int]:
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

    def _spans(self, table: PieceTable, sources: list[Source], value: bytes, empty_closes: bool) -> set[int]:
        """`_allowed` from where the text names this key path's value, if it does and one fits;
        else from every start but those of values it names for other parameters."""
        path = self._path
        named = self.named.get(path)
        if named is None and self.quoted and self.sole_required.get(self.tool) == path:
            named = self.quoted
        whole = sources is self.numbers and path in self.fractions
        if named is not None and (
            ids := self._allowed(table, sources, value, empty_closes, named, whole=whole)
        ):
            return ids
        barred = self.barred.get(path, self.barred_to_all)
        own = self.own_words.get(self.tool) if sources is self.strings else None
        if own:  # not from the tool's own words, where another start fits (an empty value aside)
            merged = {source: barred.get(source, set()) | own[source] for source in sources}
            ids = self._allowed(table, sources, value, empty_closes, excluded=merged)
            if (value and ids) or ids - set(table.closing.get(b"", ())):
                return ids
        return self._allowed(table, sources, value, empty_closes, excluded=barred, whole=whole)

    @staticmethod
    def _allowed(
        table: PieceTable,
        sources: list[Source],
        value: bytes,
        empty_closes: bool,
        named: Mapping[Source, set[int]] | None = None,
        excluded: Mapping[Source, set[int]] | None = None,
        whole: bool = False,
    ) -> set[int]:
        """Tokens that keep `value` a span of a source (one starting where `named` says for that
        source, if given, and not where `excluded` says), or end it where a span may end (`whole`:
        not before a number's fraction)."""
        empty = not value and empty_closes and named is None  # a named value is not empty
        ids: set[int] = set(table.closing.get(b"", ())) if empty else set()
        for source in sources:
            text = source.text
            begins = named.get(source, ()) if named is not None else None
            barred = excluded.get(source, ()) if excluded is not None else ()
            start = text.find(value)
            while start >= 0:
                after = start + len(value)
                last = source.last_end(start)  # a quoted value ends at its quote
                begins_here = start in begins if begins is not None else start not in barred
                if source.starts[start] and after <= last and begins_here:
                    ends_here = source.only_start.get
                    cut = source.point_ends if whole else ()
                    if value and source.ends[after] and ends_here(after, start) == start and after not in cut:
                        ids.update(table.closing.get(b"", ()))
                    for end in range(after + 1, min(last, after + table.longest) + 1):
                        written = text[after:end]
                        if source.next_end[end] <= last:  # it can still end before a wall
                            ids.update(table.continuing.get(written, ()))
                        if source.ends[end] and ends_here(end, start) == start and end not in cut:
                            ids.update(table.closing.get(written, ()))
                start = text.find(value, start + 1)
        return ids

    def restrict_(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask logits [V] (already grammar-masked) to tokens that keep a grounded value a span;
        unchanged outside one, or when no token the grammar allows would. Then, where an object
        misses a key the text names a value under, or holds optional keys the text does not
        mention, to tokens that write neither such a key nor close the object too early
        (`_keep_keys_`)."""
        self._ground_(logits)
        if (self.named_keys and self._missing_keys()) or self._holds_back_keys():
            self._keep_keys_(logits)
        return logits

    # ---- which keys an object writes -------------------------------------------------------------
    def _missing(self, depth: int) -> frozenset[bytes]:
        """The named keys the object open at `depth` of the stack has not written (of the chosen
        tool's keys, where the schema is one per tool)."""
        frame = self.stack[depth]
        if frame[0] != "object":
            return frozenset()
        path = tuple(f[1] for f in self.stack[:depth])
        missing = self.named_keys.get(path, frozenset()) - frame[3]
        if missing and depth and self.tool_paths:
            known = self.tool_paths.get(self.tool) if self.tool is not None else None
            if known is None:  # no tool chosen yet (or an unknown one): nothing to ask for
                return frozenset()
            missing = frozenset(k for k in missing if (*path, k) in known)
        return missing

    def _missing_keys(self) -> bool:
        return any(self._missing(d) for d in range(len(self.stack)))

    def _next_named(self, depth: int) -> frozenset[bytes]:
        """Of the named keys the object open at `depth` misses, the one it must write next: the
        first in the schema's order (the grammar's: a later key first would leave it out), or all
        of them where the order is not known."""
        missing = self._missing(depth)
        path = tuple(f[1] for f in self.stack[:depth])
        order = self.key_order.get(self.tool, {}).get(path)
        if len(missing) < 2 or order is None or not missing <= set(order):
            return missing
        return frozenset({min(missing, key=order.index)})

    def _keys_left(self, depth: int) -> list[bytes] | None:
        """The keys the object open at `depth` may still write, in the schema's order (the
        grammar's), where it holds back an optional key the text does not mention; None where
        it holds back none."""
        frame = self.stack[depth]
        if frame[0] != "object":
            return None
        path = tuple(f[1] for f in self.stack[:depth])
        unsaid = self.unsaid.get(self.tool, {}).get(path)
        if not unsaid:
            return None
        order = self.key_order[self.tool][path]
        last = max((order.index(k) for k in frame[3] if k in order), default=-1)
        return [k for k in order[last + 1 :] if k not in unsaid]

    def _holds_back_keys(self) -> bool:
        return bool(self.unsaid) and any(self._keys_left(d) is not None for d in range(len(self.stack)))

    def _breaks_keys(self, piece: bytes) -> bool:
        """Whether writing `piece` here closes an object that misses a named key, or writes a key
        other than the first named key it misses (keys follow the schema's order, so an unnamed
        optional key there would be a guess the text does not make, and a later named key would
        leave the first out), or writes an optional key the text does not mention (`said_keys`)."""
        probe = copy.copy(self)
        probe.stack = [[*frame[:3], set(frame[3])] for frame in self.stack]
        for c in piece:
            in_key = probe.in_string and probe.is_key and not probe.escaped
            top = len(probe.stack) - 1
            if not probe.in_string and probe.stack:
                if c == 0x7D and probe._missing(top):
                    return True
                frame = probe.stack[top]
                key_next = c == 0x2C or (c == 0x22 and frame[2])  # a comma or a key's quote
                if key_next and frame[0] == "object" and probe._keys_left(top) == []:
                    return True
            if in_key and probe.stack:
                missing, left = probe._next_named(top), probe._keys_left(top)
                if c != 0x22:
                    prefix = probe.value + bytes((c,))
                    if missing and not any(k.startswith(prefix) for k in missing):
                        return True
                    if left is not None and not any(k.startswith(prefix) for k in left):
                        return True
                elif (missing and probe.value not in missing) or (
                    left is not None and probe.value not in left
                ):
                    return True
            probe._feed_byte(c)
        return False

    def _keep_keys_(self, logits: torch.Tensor) -> None:
        """Mask the tokens the grammar (and grounding) allow that `_breaks_keys`; unchanged where
        that leaves none."""
        flat = logits.view(-1)
        if self.in_string and self.is_key:  # any piece may continue the key
            candidates = torch.nonzero(torch.isfinite(flat)).flatten().tolist()
        else:
            idx = self.index.structural_ids(flat.numel(), flat.device, quoting=self.in_string)
            if not idx.numel():
                return
            candidates = idx[torch.isfinite(flat[idx])].tolist()
        pieces = self.index.pieces
        bad = [i for i in candidates if self._breaks_keys(pieces[i])]
        if not bad:
            return
        keep = torch.isfinite(flat)
        keep[torch.tensor(bad, device=flat.device)] = False
        if bool(keep.any()):
            flat.masked_fill_(~keep, float("-inf"))

    def _ground_(self, logits: torch.Tensor) -> torch.Tensor:
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
