"""Argument values for generic tool use: how each kind of value is drawn and how it reads in a
request. Values are split by hash like the world's names (`world.in_split`), so held-out requests
carry values training never saw; non-ASCII text (CJK, kana, hangul, Cyrillic, Greek, accented
Latin) is drawn from whole Unicode blocks, so its characters are mostly new too."""

from __future__ import annotations

import random
from typing import Any

from .world import Split, in_split, place_name

WORDS = [
    "apple", "river", "garden", "window", "silver", "candle", "forest", "planet", "yellow", "bridge",
    "castle", "dragon", "engine", "falcon", "guitar", "harvest", "island", "jacket", "kitten", "lemon",
    "marble", "needle", "orange", "pepper", "rabbit", "saddle", "tunnel", "velvet", "wagon", "zebra",
    "strawberry", "banana", "notebook", "mountain", "ocean", "pencil", "rocket", "summer", "winter",
    "coffee", "butter", "cherry", "desert", "feather", "galaxy", "honey", "letter", "meadow", "puzzle",
]  # fmt: skip
ACCENTED = ["café", "naïve", "Straße", "jalapeño", "crème brûlée", "São Paulo", "Zürich", "Ærø", "Łódź"]
SCRIPT_RANGES = [
    (0x4E00, 0x9FFF, 2, 6),  # CJK ideographs
    (0x3041, 0x3096, 3, 7),  # hiragana
    (0x30A1, 0x30FA, 3, 7),  # katakana
    (0xAC00, 0xD7A3, 2, 5),  # hangul syllables
    (0x0430, 0x044F, 4, 9),  # Cyrillic lower case
    (0x03B1, 0x03C9, 4, 8),  # Greek lower case
]
FIRST = ["Ana", "Omar", "Lena", "Ivo", "Mira", "Tariq", "Ella", "Uma", "Kofi", "Yara", "Ravi", "Ines"]
SUFFIXES = ["Group", "Labs", "Corp", "Studio", "Works", "Foods", "Partners", "Systems"]
STATES = ["CA", "NY", "TX", "ON", "BC", "WA", "NSW", "QC"]
PLACE_PREFIXES = ["San", "Port", "New", "Lake", "Saint", "East", "Mount"]
CURRENCIES = ["USD", "EUR", "JPY", "GBP", "CHF", "CNY", "INR", "BRL", "KRW", "SEK"]


def _pick(rng: random.Random, split: Split, draw) -> Any:  # noqa: ANN001 - a zero-argument sampler
    while True:
        value = draw()
        if in_split(str(value), split):
            return value


def _script_text(rng: random.Random) -> str:
    low, high, shortest, longest = rng.choice(SCRIPT_RANGES)
    return "".join(chr(rng.randint(low, high)) for _ in range(rng.randint(shortest, longest)))


def place(rng: random.Random, split: Split) -> str:
    """An invented place: one word (consonant or vowel first), two words, or with a region code."""
    name = place_name(rng, split, vowel_onsets=True)
    shape = rng.random()
    if shape < 0.15:
        return f"{rng.choice(PLACE_PREFIXES)} {name}"
    if shape < 0.3:
        return f"{name}, {rng.choice(STATES)}"
    return name


def text(rng: random.Random, split: Split) -> str:
    """Free text (a name, a title, a message): English words, a company name, or another script."""
    shape = rng.random()
    if shape < 0.35:
        return _pick(rng, split, lambda: _script_text(rng))
    if shape < 0.45:
        return rng.choice(ACCENTED) + " " + rng.choice(SUFFIXES)
    if shape < 0.65:
        return f"{place_name(rng, split, vowel_onsets=True)} {rng.choice(SUFFIXES)}"
    length = rng.randint(1, 4)
    return _pick(rng, split, lambda: " ".join(rng.choice(WORDS) for _ in range(length)))


def draw(kind: str, rng: random.Random, split: Split, options: list[str] | None = None) -> Any:
    """One value of `kind` (see `generic.PARAM_KINDS`)."""
    if kind == "place":
        return place(rng, split)
    if kind == "text":
        return text(rng, split)
    if kind == "word":
        return (
            rng.choice(ACCENTED[:4]) if rng.random() < 0.15 else _pick(rng, split, lambda: rng.choice(WORDS))
        )
    if kind == "person":
        return f"{rng.choice(FIRST)} {place_name(rng, split, vowel_onsets=True)}"
    if kind == "ticker":
        return _pick(rng, split, lambda: "".join(chr(rng.randint(65, 90)) for _ in range(rng.randint(2, 5))))
    if kind == "code":
        return _pick(rng, split, lambda: f"{rng.choice('ABKQXZ')}-{rng.randint(100, 99999)}")
    if kind == "email":
        return f"{rng.choice(WORDS)}{rng.randint(1, 99)}@{rng.choice(WORDS)}.com"
    if kind == "date":
        return f"20{rng.randint(20, 35)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if kind == "currency":
        return rng.choice(CURRENCIES)
    if kind == "letter":
        return rng.choice("abcdefghilmnoprstuy")
    if kind == "int":
        return _pick(
            rng, split, lambda: rng.choice([rng.randint(0, 20), rng.randint(0, 999), rng.randint(-99, 99)])
        )
    if kind == "count":
        return _pick(rng, split, lambda: rng.randint(1, 30))
    if kind == "number":
        return _pick(rng, split, lambda: rng.choice([rng.randint(1, 500), round(rng.uniform(-50, 500), 1)]))
    if kind == "enum":
        assert options
        return rng.choice(options)
    if kind == "bool":
        return rng.random() < 0.5
    raise ValueError(f"unknown value kind {kind!r}")


def quoted(value: str, rng: random.Random) -> str:
    """Free text in a request is quoted ('...' or “...”), so where it starts and ends is visible."""
    return f"“{value}”" if rng.random() < 0.2 else f"'{value}'"
