"""Small coding tasks for the embedded model: a family of function templates, each with its
phrasings, the reference solution and generated tests. One phrasing of every template, one framing
sentence and one in four function names and constants are held out from training. A held-out
description is a new sentence made of words training has seen elsewhere ("returns the value of {a}
plus {k}"): the test is generalisation to new phrasing, names and values, not to new vocabulary."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .world import Split, in_split, number

_WORDS = [
    "alpha", "amber", "atlas", "basil", "birch", "blaze", "cedar", "cobalt", "coral", "delta", "ember",
    "fable", "fern", "flint", "gale", "garnet", "harbor", "hazel", "indigo", "iris", "jade", "juniper",
    "kelp", "lark", "lumen", "maple", "meadow", "nova", "oak", "onyx", "opal", "pebble", "pine",
    "quartz", "raven", "reed", "river", "sable", "sage", "slate", "sorrel", "spruce", "tide", "topaz",
    "umber", "vale", "willow", "wren", "yarrow", "zephyr",
]  # fmt: skip
_VERBS = ["get", "calc", "make", "find", "compute", "do", "eval", "apply"]
_INT_ARGS = ["x", "n", "value", "num"]
_LIST_ARGS = ["xs", "items", "values", "nums"]
_STR_ARGS = ["s", "text", "word"]
_LETTERS = "abcdeilmnorst"
_REPLIES = ["Here is the function:", "Sure:", "Here you go:"]

FRAMINGS = [
    "Write a Python function `{sig}` that {desc}.",
    "Implement `{sig}`: it {desc}.",
    "Create a function {name}({args}) which {desc}.",
    "Define `{sig}` so that it {desc}.",  # held out
]
# Training-only framings: more sentence shapes and opening words, so the model learns to copy the
# name in the signature's slot rather than lean on the framing it saw (a held-out "Define
# `make_vale(items)` ..." was answered "def get_vale": the first letter is the hard one to copy).
EXTRA_FRAMINGS = [
    "Please write `{sig}`, a function that {desc}.",
    "I need {name}({args}): it {desc}.",
    "Your task: implement {name}({args}), which {desc}.",
    "Program `{sig}`; it {desc}.",
    "Add a function `{sig}` that {desc}.",
    "Quickly code {name}({args}), which {desc}.",
]


@dataclass(frozen=True)
class CodeTemplate:
    key: str
    kind: str  # argument kinds: "i" int, "l" list of ints, "s" str; "k" means a constant k is used
    descriptions: list[str]  # the last one is held out
    body: list[str]  # lines of the body, formatted with the arguments and constants
    reference: Callable[..., Any]  # (args..., k=..., c=..., word=...) -> value


T = CodeTemplate
TEMPLATES: list[CodeTemplate] = [
    T("add_k", "ik", ["returns {a} plus {k}", "adds {k} to {a}", "returns the value of {a} plus {k}"],
      ["return {a} + {k}"], lambda a, k: a + k),
    T("sub_k", "ik", ["returns {a} minus {k}", "subtracts {k} from {a}",
                   "returns the value of {a} minus {k}"],
      ["return {a} - {k}"], lambda a, k: a - k),
    T("mul_k", "ik", ["returns {a} multiplied by {k}", "returns {k} times {a}",
                   "returns the value of {a} times {k}"],
      ["return {a} * {k}"], lambda a, k: a * k),
    T("pow_k", "ik", ["returns {a} raised to the power {k}", "returns {a} to the power of {k}",
                      "returns the value of {a} to the power {k}"],
      ["return {a} ** {k}"], lambda a, k: a**k),
    T("divisible", "ik", ["returns True if {a} is divisible by {k}",
                       "checks whether {a} is a multiple of {k}",
                          "returns whether {a} is divisible by {k}"],
      ["return {a} % {k} == 0"], lambda a, k: a % k == 0),
    T("sum", "l", ["returns the sum of the numbers in {a}", "adds up all numbers in {a}",
                   "returns the sum of all the numbers in {a}"],
      ["return sum({a})"], lambda a: sum(a)),
    T("max", "l", ["returns the largest number in {a}", "returns the maximum of {a}",
                   "returns the largest value in {a}"],
      ["return max({a})"], lambda a: max(a)),
    T("min", "l", ["returns the smallest number in {a}", "returns the minimum of {a}",
                   "returns the smallest value in {a}"],
      ["return min({a})"], lambda a: min(a)),
    T("count_gt", "lk", ["returns how many numbers in {a} are greater than {k}",
                         "counts the values in {a} above {k}",
                         "returns the number of values in {a} greater than {k}"],
      ["return len([v for v in {a} if v > {k}])"], lambda a, k: len([v for v in a if v > k])),
    T("filter_gt", "lk", ["returns the numbers in {a} that are greater than {k}",
                          "keeps only the values in {a} above {k}",
                          "returns only the numbers in {a} above {k}"],
      ["return [v for v in {a} if v > {k}]"], lambda a, k: [v for v in a if v > k]),
    T("squares", "l", ["returns the squares of the numbers in {a}", "squares every number in {a}",
                       "returns each number in {a} squared"],
      ["return [v * v for v in {a}]"], lambda a: [v * v for v in a]),
    T("first_k", "lk", ["returns the first {k} items of {a}", "returns the leading {k} elements of {a}",
                        "returns the first {k} values of {a}"],
      ["return {a}[:{k}]"], lambda a, k: a[:k]),
    T("reverse", "s", ["returns {a} reversed", "reverses the string {a}", "returns the string {a} reversed"],
      ["return {a}[::-1]"], lambda a: a[::-1]),
    T("upper", "s", ["returns {a} in upper case", "converts {a} to capital letters",
                   "returns the string {a} in upper case"],
      ["return {a}.upper()"], lambda a: a.upper()),
    T("count_char", "sc", ["returns how many times the letter '{c}' appears in {a}",
                           "counts the letter '{c}' in {a}", "returns the count of the letter '{c}' in {a}"],
      ["return {a}.count('{c}')"], lambda a, c: a.count(c)),
    T("repeat", "sk", ["returns {a} repeated {k} times", "repeats the string {a} {k} times",
                       "returns the string {a} repeated {k} times"],
      ["return {a} * {k}"], lambda a, k: a * k),
    T("factorial", "i", ["returns the factorial of {a}", "computes {a} factorial",
                         "returns {a} factorial"],
      ["result = 1", "for i in range(2, {a} + 1):", "    result *= i", "return result"],
      lambda a: _factorial(a)),
    T("fizz", "iwk", ["returns '{word}' if {a} is divisible by {k}, otherwise {a} as a string",
                      "returns the string '{word}' when {k} divides {a}, else str({a})",
                      "returns '{word}' when {a} is divisible by {k}, else {a} as a string"],
      ["if {a} % {k} == 0:", "    return '{word}'", "return str({a})"],
      lambda a, k, word: word if a % k == 0 else str(a)),
]  # fmt: skip


def _factorial(n: int) -> int:
    out = 1
    for i in range(2, n + 1):
        out *= i
    return out


@dataclass(frozen=True)
class CodeTask:
    """A task: the request, the function's name, a reference solution and its tests."""

    template: str
    prompt: str
    function: str
    solution: str  # the reference code (a def)
    tests: list[str] = field(default_factory=list)  # assert statements


def _function_name(rng: random.Random, split: Split) -> str:
    while True:
        name = f"{rng.choice(_VERBS)}_{rng.choice(_WORDS)}"
        if in_split(name, split):
            return name


def _inputs(rng: random.Random, kind: str, consts: dict[str, Any]) -> Any:
    if kind == "i":
        if "k" not in consts:
            return rng.randint(0, 9)
        return consts["k"] * rng.randint(0, 4) if rng.random() < 0.4 else rng.randint(0, 60)
    if kind == "l":
        return [rng.randint(-9, 30) for _ in range(rng.randint(1, 6))]
    letters = [rng.choice(_LETTERS) for _ in range(rng.randint(1, 8))]
    for _ in range(rng.randint(0, 3) if "c" in consts else 0):  # counted letters must occur
        letters.insert(rng.randint(0, len(letters)), consts["c"])
    return "".join(letters)


def code_task(rng: random.Random, split: Split, template: CodeTemplate | None = None) -> CodeTask:
    """A task from the family; held-out tasks use a held-out name and constant and a held-out
    framing or description, so the whole request is one training never saw."""
    template = template or rng.choice(TEMPLATES)
    kinds = {"i": _INT_ARGS, "l": _LIST_ARGS, "s": _STR_ARGS}
    arg_kind = template.kind[0]
    while True:
        a = rng.choice(kinds[arg_kind])
        fields: dict[str, Any] = {"a": a}
        ref_kwargs: dict[str, Any] = {}
        if "k" in template.kind:
            if template.key in ("pow_k", "repeat", "first_k"):  # too few values to split: shared
                fields["k"] = ref_kwargs["k"] = rng.randint(2, 5)
            else:
                fields["k"] = ref_kwargs["k"] = number(rng, split, 2, 99)
        if "c" in template.kind:
            fields["c"] = ref_kwargs["c"] = rng.choice(_LETTERS)
        if "w" in template.kind:
            fields["word"] = ref_kwargs["word"] = rng.choice(_WORDS).capitalize()
        name = _function_name(rng, split)
        descriptions = template.descriptions[:-1] if split == "train" else template.descriptions
        framings = FRAMINGS[:-1] + EXTRA_FRAMINGS if split == "train" else FRAMINGS
        desc, framing = rng.choice(descriptions), rng.choice(framings)
        if split == "heldout" and desc != template.descriptions[-1] and framing != FRAMINGS[-1]:
            continue
        sig = f"{name}({a})"
        prompt = framing.format(sig=sig, name=name, args=a, desc=desc.format(**fields))
        body = "\n".join("    " + line.format(**fields) for line in template.body)
        solution = f"def {sig}:\n{body}\n"
        tests = []
        for _ in range(3):
            value = _inputs(rng, arg_kind, ref_kwargs)
            expected = template.reference(value, **ref_kwargs)
            tests.append(f"assert {name}({value!r}) == {expected!r}")
        return CodeTask(template.key, prompt, name, solution, tests)


def code_reply(rng: random.Random, code: str) -> str:
    """The assistant's answer: a short lead-in and one fenced block."""
    return f"{rng.choice(_REPLIES)}\n```python\n{code}```"
