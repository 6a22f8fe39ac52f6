"""Values a text names by their parameter: `unit = km`, `ticker='LGNE'`, `duration minutes: 13`,
`new_playlist(playlist_name='X', public=False)`. Grounded arguments (`grounding.SpanGrounding`)
start such a parameter's value where the text writes it, and no other value's span runs into the
naming ("Kitu unit = km" gives a `start` of "Kitu", not "Kitu unit =").

Only a name followed by `=` or `:` names a value; prose ("the unit is km") is left to the model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def key_words(key: str) -> list[str]:
    """The ways a text writes a parameter's name: as it is, and in words (`duration_minutes`,
    `duration-minutes` and `durationMinutes` -> "duration minutes")."""
    words = " ".join(_CAMEL.sub(" ", key).replace("_", " ").replace("-", " ").split()).lower()
    return [key] if words == key.lower() else [key, words]


@dataclass(frozen=True)
class Naming:
    """A parameter named in a text: `key`, where its name starts (`start`) and where the value it
    names starts (`value`: past the quote that opens it, if one does)."""

    key: str
    start: int
    value: int


def namings(text: bytes, keys: Iterable[str], quotes: Sequence[bytes]) -> list[Naming]:
    """Every naming of one of `keys` in `text` (JSON-escaped bytes, as grounding compares them):
    a whole-word name (any case) followed by `=` or `:` and a value. `quotes`: the opening quotes a
    value may start with."""
    found: list[Naming] = []
    for key in keys:
        names = b"|".join(re.escape(w.encode()) for w in key_words(key) if w)
        if not names:
            continue
        pattern = re.compile(rb"(?<![\w])(?:" + names + rb")[ \t]*[=:][ \t]*", re.IGNORECASE)
        for match in pattern.finditer(text):
            value = match.end()
            value += next((len(q) for q in quotes if text.startswith(q, value)), 0)
            if value < len(text) and not text[value : value + 1].isspace():
                found.append(Naming(key, match.start(), value))
    return sorted(found, key=lambda n: n.start)
