"""The embedded model's world: its four tools, the questions that need them, and a split of
names, numbers and phrasings into a training part and a held-out part that training never sees.

Places are invented (syllable compounds), so a lookup can answer for any name and held-out names
are truly new to the model; tool backends are deterministic functions of their arguments.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any, Literal

from freetoken_agents import Tool, tool

Split = Literal["train", "heldout"]

SYSTEM_PROMPT = "You are a helpful assistant."

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "m", "th"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def in_split(value: str, split: Split) -> bool:
    """One in four values (by hash) is held out; training never sees them."""
    held = _digest("split:" + value) % 4 == 0
    return held if split == "heldout" else not held


def place_name(rng: random.Random, split: Split, vowel_onsets: bool = False) -> str:
    """An invented place name. With `vowel_onsets`, one in four starts with a vowel ("Osaka" was
    written "Fassaka" by a model that had only seen consonant-initial names); the default keeps the
    world's questions, and so today's held-out figures, as they were."""
    while True:
        parts = [
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(2, 3))
        ]
        if vowel_onsets and rng.random() < 0.25:
            parts[0] = parts[0].lstrip("bdfgklmnprstvz")
        name = "".join(parts).capitalize()
        if 4 <= len(name) <= 12 and in_split(name, split):
            return name


def number(rng: random.Random, split: Split, low: int, high: int) -> int:
    while True:
        n = rng.randint(low, high)
        if in_split(str(n), split):
            return n


# ---- the tools (the same objects the demo, the recipes and the corpus use) -------------------------
@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def weather_report(city: str) -> dict[str, Any]:
    h = _digest("weather:" + city.strip().lower())
    return {"city": city, "condition": CONDITIONS[h % len(CONDITIONS)], "temperature_c": h // 7 % 35 - 5}


@tool
def get_weather(city: str) -> dict[str, Any]:
    """Current weather for a city."""
    return weather_report(city)


def capital_of(country: str) -> str:
    return place_name(random.Random(_digest("capital:" + country.strip().lower())), "train")


@tool
def lookup_capital(country: str) -> dict[str, str]:
    """The capital city of a country."""
    return {"country": country, "capital": capital_of(country)}


TOOLS: list[Tool] = [add, multiply, get_weather, lookup_capital]


# ---- questions ---------------------------------------------------------------------------------------
# The last phrasing of each intent (and the last politeness frame) is held out.
PHRASINGS: dict[str, list[str]] = {
    "add": [
        "What is {a} plus {b}?",
        "Add {a} and {b}.",
        "Compute the sum of {a} and {b}.",
        "What do you get when you add {a} to {b}?",
        "Calculate {a} + {b}.",
        "Find the sum of {a} and {b}.",
        "Can you add {a} and {b}?",
        "Sum up {a} and {b}.",
        "How much is {a} plus {b}?",
    ],
    "multiply": [
        "What is {a} times {b}?",
        "Multiply {a} by {b}.",
        "Compute the product of {a} and {b}.",
        "What do you get when you multiply {a} by {b}?",
        "Calculate {a} * {b}.",
        "Find the product of {a} and {b}.",
        "Can you multiply {a} by {b}?",
        "Work out {a} times {b}.",
        "How much is {a} times {b}?",
    ],
    "get_weather": [
        "What is the weather in {city}?",
        "How is the weather in {city} today?",
        "Tell me the current weather for {city}.",
        "Is it raining in {city}?",
        "Show me the weather in {city}.",
        "Check the weather in {city}, please.",
        "Can you look up the weather in {city}?",
        "Report the weather for {city}.",
        "What's the forecast for {city} right now?",
        "Give me the weather report for {city}.",
    ],
    "lookup_capital": [
        "What is the capital of {country}?",
        "Which city is the capital of {country}?",
        "Tell me the capital city of {country}.",
        "Name the capital of {country}.",
        "What's {country}'s capital?",
        "Find the capital of {country}.",
        "Look up the capital of {country}.",
        "Can you tell me the capital of {country}?",
        "Get me the capital of {country}.",
        "Do you know the capital of {country}?",
    ],
}
FRAMES = ["{q}", "Please help: {q}", "{q} Thanks!", "Hi! {q}", "Quick question. {q}"]
# Training-only frames that start the question with other capitalised words. The model copies a
# name from the question into the call; with the same few opening words in every training
# question it learnt "copy the unfamiliar capitalised word", and a held-out question opening
# with an unseen word ("Give me the weather report for Brinvo") got that word, or its first
# letter, in the call. (Frames naming a second place after "in"/"from" were tried: the model then
# could not tell the two apart and guessed every first letter; 54% exact.)
STARTERS = [
    "Okay", "Well", "Now", "Sure", "Also", "Next", "Then", "Right", "Listen", "Hello", "Question",
    "Again", "Sorry", "Honestly", "Friend", "Today", "Yes", "Great", "Morning", "Urgent", "Curious",
    "Help", "Note", "Request", "Ahoy", "Greetings", "Alright", "Anyway", "Perfect", "Cool",
]  # fmt: skip
STARTER_FRAMES = ["{starter}. {q}", "{starter}, {q_lower}", "{starter}! {q}", "{starter}: {q}"]
CHITCHAT = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there.", "Hi! What can I do for you?"),
    ("Thank you!", "You're welcome!"),
    (
        "Who are you?",
        "I am a small assistant that can add, multiply, check the weather and look up capitals.",
    ),
    ("Good morning.", "Good morning! How can I help?"),
]
ANSWERS: dict[str, list[str]] = {
    "add": ["{a} plus {b} is {r}.", "The sum of {a} and {b} is {r}.", "{a} + {b} = {r}."],
    "multiply": ["{a} times {b} is {r}.", "The product of {a} and {b} is {r}.", "{a} * {b} = {r}."],
    "get_weather": [
        "It is {condition} in {city}, {temperature_c}°C.",
        "The weather in {city} is {condition} with {temperature_c}°C.",
    ],
    "lookup_capital": ["The capital of {country} is {capital}.", "{capital} is the capital of {country}."],
}


@dataclass(frozen=True)
class ToolQuestion:
    """A user question and the one call that answers it."""

    question: str
    tool: str
    arguments: dict[str, Any]


def _phrasings(intent: str, split: Split) -> list[str]:
    options = PHRASINGS[intent]
    return options[:-1] if split == "train" else options


def _frames(split: Split) -> list[str]:
    return FRAMES[:-1] + STARTER_FRAMES if split == "train" else FRAMES


def _framed(frame: str, question: str, starter: str) -> str:
    return frame.format(q=question, q_lower=question[0].lower() + question[1:], starter=starter)


def tool_question(
    rng: random.Random, split: Split, intent: str | None = None, vowel_onsets: bool = False
) -> ToolQuestion:
    """A question for one of the tools. Held-out questions use held-out values and a held-out
    phrasing or frame, so the whole prompt is one training never saw. `vowel_onsets`: see
    `place_name` (the corpus sets it; the evaluation keeps today's questions)."""
    intent = intent or rng.choice(list(PHRASINGS))
    while True:
        if intent in ("add", "multiply"):
            high = 999 if intent == "add" else 99
            args: dict[str, Any] = {"a": number(rng, split, 2, high), "b": number(rng, split, 2, high)}
        elif intent == "get_weather":
            args = {"city": place_name(rng, split, vowel_onsets)}
        else:
            args = {"country": place_name(rng, split, vowel_onsets)}
        template = rng.choice(_phrasings(intent, split))
        frame = rng.choice(_frames(split))
        starter = rng.choice(STARTERS) if "{starter}" in frame else ""
        question = _framed(frame, template.format(**args), starter)
        unseen = template == PHRASINGS[intent][-1] or frame == FRAMES[-1]
        if split == "train" or unseen:
            return ToolQuestion(question, intent, args)


def final_answer(rng: random.Random, question: ToolQuestion, result: Any) -> str:
    if question.tool in ("add", "multiply"):
        fields = {**question.arguments, "r": result}
    else:
        fields = dict(result)
    return rng.choice(ANSWERS[question.tool]).format(**fields)


def call_tool(name: str, arguments: dict[str, Any]) -> Any:
    by_name = {t.name: t for t in TOOLS}
    return by_name[name].call(by_name[name].validate(arguments))
