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

Here: the texts a call may copy from, what a schema grounds (key paths by kind, per tool), and
`SpanGrounding`, built from `json_cursor` (where the JSON being written stands), `named_starts`
(what the text names, worked out once per call), `span_tokens` (the tokens that keep a value a
span) and `grounded_keys` (which keys an object writes).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from .grounded_keys import KeyRules
from .named_starts import text_namings
from .said_keys import ANY_ITEM, ObjectKeys, Path, objects_of, unsaid_keys
from .span_tokens import enum_tokens, span_tokens
from .spans import LOWER_WORD, PieceTable, Source, SpanIndex, escaped


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


class SpanGrounding(KeyRules):
    """Follows a JSON value as it is written (`JsonCursor`) and, inside a grounded string or
    number, masks the tokens that would make it something no source contains, and those that
    break the key rules (`KeyRules`). `feed` every accepted piece; `restrict_` the
    (grammar-masked) logits before sampling."""

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
        self.string_paths, self.number_paths = string_paths, number_paths
        # A number that may not be an integer is written whole ("66.7", not "66"); None: any may.
        self.fractions = number_paths - integer_paths if integer_paths is not None else frozenset()
        # Per tool (None: a schema that is no call), its one required plain string parameter.
        self.sole_required = sole_required or {}
        texts = {escaped(s, ascii_only) for s in sources if s for ascii_only in (False, True)}
        self.strings = [Source(t) for t in sorted(texts)]
        self.numbers = [Source(s.encode(), number=True) for s in sources if s]
        # What the text names (`named_starts`): the starts each key path's value takes (`named`)
        # and those barred to it, the enum values it mentions, the booleans it names with a truth
        # word, the one value it quotes, and the keys an object does not close without.
        namings = text_namings(
            sources, self.strings, self.numbers, string_paths, number_paths, enum_paths or {}, boolean_paths
        )
        self.named, self.barred, self.barred_to_all = namings.named, namings.barred, namings.barred_to_all
        self.mentioned, self.truths, self.quoted = namings.mentioned, namings.truths, namings.quoted
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
        key_order = {tool: {path: keys.order for path, keys in by.items()} for tool, by in objects.items()}
        # The key rules (`grounded_keys`), with each tool's key paths (`tool_key_paths`): a key the
        # text names for one tool's parameter is not asked of another tool's call (its schema has
        # no such key).
        super().__init__(
            index, namings.named_keys, tool_paths or {}, key_order, unsaid_keys(objects, sources, said_paths)
        )

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
            return enum_tokens(self.index.string, self.mentioned.get(self._path, ()), self.value)
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
                ids |= enum_tokens(strings, self.mentioned[path], b"")
        else:
            ids = set(strings.ids)
        if path in self.number_paths:
            ids |= self._spans(numbers, self.numbers, b"", empty_closes=False)
        else:
            ids |= numbers.ids
        return ids

    def _spans(self, table: PieceTable, sources: list[Source], value: bytes, empty_closes: bool) -> set[int]:
        """`span_tokens` from where the text names this key path's value, if it does and one fits;
        else from every start but those of values it names for other parameters."""
        path = self._path
        named = self.named.get(path)
        if named is None and self.quoted and self.sole_required.get(self.tool) == path:
            named = self.quoted
        whole = sources is self.numbers and path in self.fractions
        if named is not None and (
            ids := span_tokens(table, sources, value, empty_closes, named, whole=whole)
        ):
            return ids
        barred = self.barred.get(path, self.barred_to_all)
        own = self.own_words.get(self.tool) if sources is self.strings else None
        if own:  # not from the tool's own words, where another start fits (an empty value aside)
            merged = {source: barred.get(source, set()) | own[source] for source in sources}
            ids = span_tokens(table, sources, value, empty_closes, excluded=merged)
            if (value and ids) or ids - set(table.closing.get(b"", ())):
                return ids
        return span_tokens(table, sources, value, empty_closes, excluded=barred, whole=whole)

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
