"""Values a text names by their parameter: `unit = km`, `ticker='LGNE'`, `duration minutes: 13`,
`new_playlist(playlist_name='X', public=False)`. Grounded arguments (`grounding.SpanGrounding`)
start such a parameter's value where the text writes it, and no other value's span runs into the
naming ("Kitu unit = km" gives a `start` of "Kitu", not "Kitu unit =").

A name names a value when `=`, `:` or "set to" follows it (`unit: km`, `breakfast set to off`),
or a quoted value (`subject 'Q3'`), a number (`nights 27`, `date 2030-05-25`) or a code in
capitals (`currency CHF`), or when it is listed after "with", "and", a comma or the name of the
object holding it (`with letter c`, `SZ, currency gbp`, `room building pepper and floor 13`: the
naming starts at "with" or "and"); so do "named", "called" and "titled" (`a customer named
'Acme'`) for the parameter whose word comes just before them (customer_name), or else for the one
parameter whose name is a name or a title. Other prose ("the unit is km") is left to the model; a
parameter's bare name before anything else (`unit km`) names nothing but is a place no other
value's span runs into (`mentions`).
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


def _name_pattern(key: str) -> re.Pattern[bytes] | None:
    """A whole-word (any case) occurrence of one of the ways a text writes `key`."""
    names = b"|".join(re.escape(w.encode()) for w in key_words(key) if w)
    return re.compile(rb"(?<![\w])(?:" + names + rb")(?![\w])", re.IGNORECASE) if names else None


# `unit: km`, `unit = km`, `unit set to km`
_SIGN = re.compile(rb"[ \t]*[=:][ \t]*|[ \t]+set[ \t]+to[ \t]+", re.IGNORECASE)
GAP = re.compile(rb"[ \t]+")  # white space within a line
_LOOK_BACK = 64  # bytes before a name or a verb searched for what precedes it
_LISTED = re.compile(rb"(?:(?<![\w])(?:with|and)|,)[ \t]+$", re.IGNORECASE)
_VERB = re.compile(rb"(?<![\w])(named|called|titled)[ \t]+", re.IGNORECASE)
_LAST_WORD = re.compile(rb"(\w+)[ \t]+$")
_SHAPED = re.compile(rb"-?[0-9]|[A-Z]{2,6}(?![\w])")  # a number, or a code in capitals
_VERB_NOUNS = {b"named": ("name", "title"), b"called": ("name", "title"), b"titled": ("title",)}


def namings(
    text: bytes, keys: Iterable[str], quotes: Sequence[bytes], containers: Iterable[str] = ()
) -> list[Naming]:
    """Every naming of one of `keys` in `text` (JSON-escaped bytes, as grounding compares them):
    a whole-word name (any case) followed by `=` or `:` and a value, or by a quoted value; or
    "named", "called" or "titled" and a value (see the module). `quotes`: the opening quotes a
    value may start with; `containers`: the names of the objects that hold parameters, after
    which a parameter's name is listed as after "with" (`with room building pepper`)."""
    keys = list(keys)
    holders = {w for c in containers for w in (c.lower(), key_words(c)[-1].lower().split()[-1])}

    def value_at(k: int) -> tuple[int, bool] | None:  # (where the value starts, whether quoted)
        quote = next((len(q) for q in quotes if text.startswith(q, k)), 0)
        k += quote
        return (k, quote > 0) if k < len(text) and not text[k : k + 1].isspace() else None

    found: list[Naming] = []
    for key in keys:
        if (pattern := _name_pattern(key)) is None:
            continue
        for match in pattern.finditer(text):
            if sign := _SIGN.match(text, match.end()):
                if value := value_at(sign.end()):
                    found.append(Naming(key, match.start(), value[0]))
            elif (gap := GAP.match(text, match.end())) and (value := value_at(gap.end())):
                window = max(0, match.start() - _LOOK_BACK)  # not the whole prefix: linear time
                lead = _LISTED.search(text, window, match.start())  # "SZ, currency GBP"
                listed = lead is not None
                if not listed and holders and (before := _LAST_WORD.search(text, window, match.start())):
                    listed = before.group(1).decode("utf-8", "replace").lower() in holders
                shaped = _SHAPED.match(text, value[0]) is not None  # `nights 27`, `currency CHF`
                if value[1] or ((listed or shaped) and key.lower() not in FUNCTION_WORDS):
                    # "café| and floor 27": a listing word starts the naming, not the name
                    start = lead.start() if lead is not None and text[lead.start()] != 0x2C else match.start()
                    found.append(Naming(key, start, value[0]))
    words = {key: key_words(key)[-1].lower().split() for key in keys}
    for match in _VERB.finditer(text):
        if (value := value_at(match.end())) is None:
            continue
        before = _LAST_WORD.search(text, max(0, match.start() - _LOOK_BACK), match.start())
        word = before.group(1).decode("utf-8", "replace").lower() if before else ""
        by_word = [k for k in keys if word and {word, word.removesuffix("s")} & set(words[k])]
        nouns = _VERB_NOUNS[match.group(1).lower()]
        by_noun = [k for k in keys if set(nouns) & set(words[k])]
        for key in by_word or (by_noun if len(by_noun) == 1 else []):
            found.append(Naming(key, match.start(), value[0]))
    return sorted(found, key=lambda n: n.start)


def mentions(text: bytes, keys: Iterable[str]) -> list[int]:
    """Where `text` writes one of `keys` by name (whole words, any case), named value or not:
    `currency GBP`. No other value's span runs into such a place ("SZ, currency GBP" gives a
    ticker of "SZ"). A key that is a function word (`to`, `from`) is left out: "a trip to Paris"
    does not name it."""
    return sorted({start for _, start, _ in name_matches(text, keys)})


def name_matches(text: bytes, keys: Iterable[str]) -> list[tuple[str, int, int]]:
    """(key, start, end) of every whole-word name (any case) of one of `keys` in `text`, but those
    of keys that are function words (`mentions`)."""
    return [
        (key, m.start(), m.end())
        for key in keys
        if key.lower() not in FUNCTION_WORDS and (p := _name_pattern(key))
        for m in p.finditer(text)
    ]


# English words too common in any request for a parameter so named to be found by its bare name.
FUNCTION_WORDS = frozenset(
    "a an the to from in on at by for with of and or not no is are be as it its i me my we us our"
    " you your he she they them this that these those if so than then up out off into onto over"
    " under about via per do".split()
)
