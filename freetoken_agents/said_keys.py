"""Optional parameters the conversation never mentions: under grounded arguments a call does not
write them.

A small model fills optional parameters the request never asks for: a meeting room on floor 1, a
date of "tool" (from "Please use a tool."), `public: false`, a target language of "japanese" for
a text with none. Grounding copies every value from the text; the choice to write an optional
key at all is grounded the same way. An optional key may be written where the conversation
mentions it: its name (as it is or in words, `duration_minutes` -> "duration minutes") or one of
the words of its name ("for 30 minutes"; "a" or "of" are no such word), the name of a key within
it (a `room` object by "building"), or a value grounding found for it (an enum value the text
writes, "in km"; a value named by its parameter; a boolean's truth word). Required keys are never
held back, nor an object's first key: a schema that leaves its main parameter optional
(`get_weather(city=None)`, a tool whose arguments all have defaults) still gets "weather in
Paris" as its city. A request that implies an optional value without any of these ("translate it to
Spanish" for a plain-string `target_language`) loses the value: an argument left out is
the price of never inventing one.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

from .named_values import FUNCTION_WORDS, key_words
from .spans import escaped

Path = tuple[bytes, ...]  # a value's key path: JSON-escaped keys from the schema's root
ANY_ITEM = b"*"  # an array's element in a key path
_MAX_DEPTH = 32


class ObjectKeys(NamedTuple):
    """One object of a schema: its keys in the schema's order (the order a grammar writes them),
    and per optional key but the first, the names that mention it (its own, and those of the keys
    within it)."""

    order: tuple[bytes, ...]
    optional: dict[bytes, frozenset[str]]


def objects_of(schema: Any) -> dict[Path, ObjectKeys]:
    """Per object's key path in `schema` (from its root), its `ObjectKeys`. An object whose schema
    has branches (anyOf, oneOf, allOf) is left out: which keys it takes depends on the branch."""
    objects: dict[Path, ObjectKeys] = {}
    _walk(schema, (), objects, 0)
    return objects


def _walk(schema: Any, path: Path, objects: dict[Path, ObjectKeys], depth: int) -> frozenset[str]:
    """Record the objects in `schema` at `path`; returns every key name within it."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return frozenset()
    names: set[str] = set()
    if isinstance(schema.get("items"), dict):
        names |= _walk(schema["items"], (*path, ANY_ITEM), objects, depth + 1)
    props = schema.get("properties")
    if not isinstance(props, dict):
        return frozenset(names)
    required = set(schema.get("required") or ())
    optional: dict[bytes, frozenset[str]] = {}
    for n, (key, sub) in enumerate(props.items()):
        inner = _walk(sub, (*path, escaped(key)), objects, depth + 1)
        names |= {key, *inner}
        if key not in required and n:  # the first key: the main parameter, required or not
            optional[escaped(key)] = frozenset({key, *inner})
    if not {"anyOf", "oneOf", "allOf"} & schema.keys():
        objects[path] = ObjectKeys(tuple(escaped(k) for k in props), optional)
    return frozenset(names)


def _words(key: str) -> list[str]:
    """The words a text may mention `key` by: its name as it is and in words, and each word of
    that of three letters or more that is no function word."""
    names = key_words(key)
    words = [w for w in names[-1].lower().split() if len(w) >= 3 and w not in FUNCTION_WORDS]
    return [*names, *words]


def unsaid_keys(
    objects: dict[bytes | None, dict[Path, ObjectKeys]],
    texts: Sequence[str],
    said_paths: Collection[Path],
) -> dict[bytes | None, dict[Path, frozenset[bytes]]]:
    """Per tool, per object path, its optional keys the conversation does not mention (module
    docstring): by a name in `texts`, whole words, any case, a plural's "s" aside; or by a value
    grounding found at or below the key's path (`said_paths`)."""
    words = {w.lower() for text in texts for w in re.findall(r"\w+", text)}
    phrases = [text.lower() for text in texts]

    def mentioned(name: str) -> bool:
        for form in _words(name):
            form = form.lower()
            if " " in form:
                pattern = rf"(?<!\w){re.escape(form)}(?!\w)"
                if any(re.search(pattern, text) for text in phrases):
                    return True
            elif {form, form + "s", form.removesuffix("s")} & words:
                return True
        return False

    out: dict[bytes | None, dict[Path, frozenset[bytes]]] = {}
    for tool, by_path in objects.items():
        for path, keys in by_path.items():
            unsaid = frozenset(
                key
                for key, names in keys.optional.items()
                if not any(mentioned(n) for n in names)
                and not any(p[: len(path) + 1] == (*path, key) for p in said_paths)
            )
            if unsaid:
                out.setdefault(tool, {})[path] = unsaid
    return out
