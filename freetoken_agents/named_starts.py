"""Where the conversation names each parameter's value (`unit = km`, `ticker='LGNE'`: the
namings `named_values` finds, and email addresses for address parameters), worked out once per
call from the sources' texts: the starts each key path's value takes, the starts barred to every
other parameter, the enum values the text mentions (narrowed to the one it names), the booleans
it names with a truth word, the one value it quotes, and the keys an object does not close
without. `grounding.SpanGrounding` masks tokens with these tables.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from .named_values import key_words
from .said_keys import ANY_ITEM, Path
from .spans import Source, escaped

# Parameter names (in words, `key_words`) whose value is an email address: where the text writes
# one, such a string parameter's value is one the text writes (as if named: `unit = km`).
ADDRESS_KEYS = frozenset({"to", "recipient", "recipients", "email", "email address", "cc", "bcc"})


class Namings(NamedTuple):
    """What the text names, per key path (`Path`) and per source (`Source`, by start offset)."""

    named: dict[Path, dict[Source, set[int]]]  # where each path's value starts, where the text names it
    barred: dict[Path, dict[Source, set[int]]]  # the starts the text names for other parameters
    barred_to_all: dict[Source, set[int]]  # every named start (an array's item, a top-level value)
    mentioned: dict[Path, list[bytes]]  # the enum values the text mentions (escaped), per path
    truths: dict[Path, bytes]  # a boolean's truth word, where the text names it with one only
    quoted: dict[Source, set[int]] | None  # the one value the text quotes that no naming claims
    named_keys: dict[Path, frozenset[bytes]]  # per object path, the keys it does not close without


def text_namings(
    sources: Sequence[str],
    strings: list[Source],
    numbers: list[Source],
    string_paths: frozenset[Path],
    number_paths: frozenset[Path],
    enum_paths: Mapping[Path, Iterable[str]],
    boolean_paths: frozenset[Path],
) -> Namings:
    """The `Namings` of the conversation's `sources` (`strings`, `numbers`: their escaped texts and
    their numbers) for a schema's key paths by kind (`grounding.schema_paths`)."""
    # Enum values written in the conversation, per path: the value is one of them where any is.
    mentioned: dict[Path, list[bytes]] = {}
    for path, values in enum_paths.items():
        if said := [escaped(v) for v in sorted(values) if _mentioned(v, sources)]:
            mentioned[path] = said
    # Values the text names by their parameter, per key path: source -> where they start; and
    # the booleans it names with a truth word, where it names each with one only.
    named: dict[Path, dict[Source, set[int]]] = {}
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
    for source in (*strings, *numbers):
        starts_by_key, truth_words = source.name_values(by_key, containers)
        for key, starts in starts_by_key.items():
            for path in by_key[key]:
                named.setdefault(path, {})[source] = starts
            for start in starts:
                claimed.setdefault(source, {}).setdefault(start, set()).add(key)
        if source.addresses:  # an address parameter takes an address the text writes
            for key in address_keys:
                for path in by_key[key]:
                    if path in string_paths and source not in named.get(path, {}):
                        named.setdefault(path, {})[source] = set(source.addresses)
                for start in source.addresses:
                    claimed.setdefault(source, {}).setdefault(start, set()).add(key)
        if not source.number:  # truth words as the model writes them: the escaped texts
            for key, words in truth_words.items():
                said.setdefault(key, set()).update(words)
    # Per key path, the starts the text names for other parameters ("trimel to -33.3,
    # offset: 94": 94 is the offset's, not x's), once here rather than at every token.
    barred: dict[Path, dict[Source, set[int]]] = {
        path: {
            source: {start for start, keys in by_start.items() if key not in keys}
            for source, by_start in claimed.items()
        }
        for key, paths in by_key.items()
        for path in paths
    }
    # An array's items and a value at the top are no parameter's: every named start is barred.
    barred_to_all = {source: set(by_start) for source, by_start in claimed.items()}
    # An enum the text names (`source language english`) takes the value named, not any
    # value the text mentions ("translate to spanish, source language english").
    for path, said_values in list(mentioned.items()):
        by_source = named.get(path)
        if not by_source:
            continue
        at_naming = [
            v
            for v in said_values
            if any(_written_at(src.text, at, v) for src, starts in by_source.items() for at in starts)
        ]
        if at_naming:
            mentioned[path] = at_naming
    truths: dict[Path, bytes] = {}
    for key, words in said.items():
        for path in by_key[key]:
            if len(words) == 1 and path in boolean_paths and path not in string_paths | number_paths:
                truths[path] = next(iter(words))
    # The one value the text quotes that no naming claims, where it quotes one only (the same
    # text counted once, in both escapings): the value of the tool's one required plain string
    # parameter, where it has one (`sole_required_strings`).
    quoted: dict[bytes, dict[Source, set[int]]] = {}
    for source in strings:
        for first, end in source.only_end.items():
            if first not in claimed.get(source, {}):
                text = json.loads(b'"' + source.text[first:end] + b'"')
                quoted.setdefault(text.encode(), {}).setdefault(source, set()).add(first)
    quoted_value = next(iter(quoted.values())) if len(quoted) == 1 else None
    # Per object's key path, the keys the text names a value under (`unit = km`, `public:
    # no`, and the keys leading to such a value): the object does not close without them.
    named_keys: dict[Path, frozenset[bytes]] = {}
    named_paths = [p for p, by in named.items() if any(by.values())] + list(truths)
    for path in named_paths:
        if ANY_ITEM not in path:
            for depth in range(len(path)):
                keys = named_keys.get(path[:depth], frozenset())
                named_keys[path[:depth]] = keys | {path[depth]}
    return Namings(named, barred, barred_to_all, mentioned, truths, quoted_value, named_keys)


def _mentioned(value: str, sources: Sequence[str]) -> bool:
    """Whether `value` is written in a source as a whole word (case aside)."""
    pattern = re.compile(rf"(?<!\w){re.escape(value)}(?!\w)", re.IGNORECASE)
    return any(pattern.search(text) for text in sources)


def _written_at(text: bytes, start: int, value: bytes) -> bool:
    """Whether `text` writes `value` (case aside) as a whole word at `start`."""
    end = start + len(value)
    if text[start:end].lower() != value.lower():
        return False
    return end == len(text) or not (chr(text[end]).isalnum() or text[end] == 0x5F)
