"""Bounded JSON grammars: every value a constrained decode writes under a JSON schema ends.

xgrammar's grammar of a JSON schema lets a free string, a number's digits, an array's items and an
object's properties run on without end, and a small model does run on: on the embedded model,
`{"name": str, "age": int}` for "hello" wrote `"age": 42226666...` until the context was full (32 s,
then finish_reason "length"), and `client.chat.completions.parse(response_format=Model)` without
`max_tokens` ended with `LengthFinishReasonError`. `bounded_json_ebnf` converts the schema with
xgrammar and then rewrites its grammar so that nothing repeats without an upper bound
(`BoundedCompiler` is the compiler `GrammarFactory` compiles JSON schemas with):

- a string without `maxLength` is closed by the decoder once it holds `string_limit(schema)`
  characters (MAX_STRING_CHARS, or the longest `maxLength`/`minLength` the schema asks for): the
  lexer counts them and the decoder then allows only tokens that close it (`ConstrainedDecode`).
  Not in the grammar: a repeated character that may be an escape made xgrammar's mask ~3,000x
  slower (32 ms a token on the embedded model's 1,024 tokens); a repeated class costs nothing.
  A string the schema bounds keeps its bound; its characters are no longer raw control
  characters (xgrammar allowed a raw tab, which `json.loads` refuses);
- a number has at most MAX_INTEGER_DIGITS digits before its point (2^53, the largest integer every
  JSON parser keeps exact, has 16), MAX_FRACTION_DIGITS after it and MAX_EXPONENT_DIGITS in its
  exponent (1e308 is the largest double); integers with `minimum`/`maximum` keep xgrammar's range;
- an array without `maxItems` has at most MAX_ITEMS items, an object without a fixed set of
  properties (`additionalProperties`, `json_object` mode) at most MAX_PROPERTIES, and a value of
  any type (`{}`, `json_object`) nests at most MAX_ANY_DEPTH arrays or objects deep.

Why 512 characters: about 100 English words (~128 tokens of a real model's BPE), room for the
sentence-sized fields structured output is used for (names, labels, a summary), while a runaway
string costs at most 512 sampled tokens even at one character per token: a quarter of the
embedded model's 2,048-token context. A field meant to be longer says so with `maxLength`.

What is not rewritten: a `pattern` (the caller's regex is its own bound) and recursion through
`$ref` (`check_schema` makes sure it can end; the token budget's closing policy ends it).
Every repetition is written on a rule (`x{0, 512}` with `x ::= [...]`): xgrammar counts a repeated
rule and does not expand it, so the bounds cost nothing to compile.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = [
    "MAX_ANY_DEPTH",
    "MAX_EXPONENT_DIGITS",
    "MAX_FRACTION_DIGITS",
    "MAX_INTEGER_DIGITS",
    "MAX_ITEMS",
    "MAX_PROPERTIES",
    "MAX_STRING_CHARS",
    "BoundedCompiler",
    "bound_ebnf",
    "bounded_json_ebnf",
    "string_limit",
]

MAX_STRING_CHARS = 512
MAX_INTEGER_DIGITS = 16
MAX_FRACTION_DIGITS = 16
MAX_EXPONENT_DIGITS = 3
MAX_ITEMS = 64
MAX_PROPERTIES = 64
MAX_ANY_DEPTH = 6

_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$")
_UNBOUNDED = re.compile(r"([A-Za-z0-9_]*)\{(\d+), -1\}")
# xgrammar's character of a string with a length bound: any but a quote, a backslash, CR, LF
_BOUNDED_CHARACTER = r"(([^\"\\\r\n]))"
# ours: not a control character either (a raw tab in a string is not JSON); one class, not an
# alternation with escapes, which made the mask ~3,000x slower to compute (32 ms per token)
_STRING_CHARACTER = r"[^\0-\x1f\"\\]"

# The basic rules xgrammar shares between every schema's grammar, bounded. ftb_: ours.
_BASIC = {
    "basic_integer": rf'"0" | "-"? [1-9] ftb_digit{{0, {MAX_INTEGER_DIGITS - 1}}}',
    "basic_number": (
        rf'"-"? ("0" | [1-9] ftb_digit{{0, {MAX_INTEGER_DIGITS - 1}}}) '
        rf'("." ftb_digit{{1, {MAX_FRACTION_DIGITS}}})? '
        rf"([eE] [+\-]? ftb_digit{{1, {MAX_EXPONENT_DIGITS}}})?"
    ),
    "basic_any": "ftb_value_0",
    "basic_array": "ftb_array_0",
    "basic_object": "ftb_object_0",
}


def _helpers() -> dict[str, str]:
    rules = {
        "ftb_digit": "[0-9]",
    }
    scalars = "basic_number | basic_string | basic_boolean | basic_null"
    for depth in range(MAX_ANY_DEPTH):
        inner = f"ftb_value_{depth + 1}"
        rules[f"ftb_value_{depth}"] = f"{scalars} | ftb_array_{depth} | ftb_object_{depth}"
        rules[f"ftb_array_{depth}"] = f'"[" "]" | "[" {inner} ftb_item_{depth}{{0, {MAX_ITEMS - 1}}} "]"'
        rules[f"ftb_item_{depth}"] = f'", " {inner}'
        rules[f"ftb_object_{depth}"] = (
            f'"{{" "}}" | "{{" basic_string ": " {inner} ftb_member_{depth}{{0, {MAX_PROPERTIES - 1}}} "}}"'
        )
        rules[f"ftb_member_{depth}"] = f'", " basic_string ": " {inner}'
    # the deepest level: no more arrays or objects
    rules[f"ftb_value_{MAX_ANY_DEPTH}"] = scalars
    return rules


_HELPERS = _helpers()
# parts of xgrammar's basic rules that ours replace (left out rather than left unused)
_REPLACED_PARTS = frozenset(
    ("basic_integer_1", "basic_number_digits", "basic_array_items", "basic_object_properties")
    + tuple(f"basic_number_{i}" for i in range(1, 6))
)


def bound_ebnf(ebnf: str) -> str:
    """`ebnf` (a grammar as xgrammar prints it, one rule a line) with every JSON value bounded
    (module docstring): the basic rules replaced, each unbounded repetition `{m, -1}` given an
    upper bound (MAX_STRING_CHARS for a string's characters, MAX_ITEMS otherwise: an array's items,
    an object's extra properties) and each bounded string's character allowed escapes."""
    out: list[str] = []
    for line in ebnf.splitlines():
        match = _RULE.match(line)
        if match is None:
            if line.strip():
                out.append(line)
            continue
        name, body = match.groups()
        if name in _BASIC or name in _HELPERS or name in _REPLACED_PARTS:
            continue  # ours below
        if name.endswith("_characters") and body == _BOUNDED_CHARACTER:
            body = _STRING_CHARACTER
        body = _UNBOUNDED.sub(_bounded_repetition, body)
        out.append(f"{name} ::= {body}")
    out += [f"{name} ::= {body}" for name, body in {**_BASIC, **_HELPERS}.items()]
    return "\n".join(out) + "\n"


def _bounded_repetition(match: re.Match[str]) -> str:
    """`x{m, -1}` -> `x{m, max(m, bound)}`: a string's characters up to MAX_STRING_CHARS, anything
    else (items, properties) up to MAX_ITEMS."""
    repeated, least = match.group(1), int(match.group(2))
    bound = MAX_STRING_CHARS if repeated.endswith("_characters") else MAX_ITEMS
    return f"{repeated}{{{least}, {max(least, bound)}}}"


def string_limit(schema: Any) -> int:
    """The characters the decoder lets a string without a bound of its own run to: MAX_STRING_CHARS,
    or the largest `maxLength` / `minLength` in `schema` when that is more (a string the schema
    wants longer is never cut short). Iterative: `check_schema` has bounded the schema's size."""
    limit, stack = MAX_STRING_CHARS, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in ("maxLength", "minLength"):
                value = node.get(key)
                if isinstance(value, int) and not isinstance(value, bool):
                    limit = max(limit, value)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return limit


def bounded_json_ebnf(schema: dict[str, Any], xgrammar: Any) -> str:
    """The bounded grammar (EBNF text, root rule `root`) of one JSON value under `schema`, compact
    as json.dumps writes it (", " and ": "), properties in the schema's order; `xgrammar`: the
    module (imported lazily by the caller)."""
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    return bound_ebnf(str(grammar))


class BoundedCompiler:
    """xgrammar's `GrammarCompiler` whose JSON schemas compile bounded: `compile_json_schema` (the
    schema's JSON text; compact, strict: the only way this package compiles them) compiles
    `bounded_json_ebnf`; every other member is the compiler's own."""

    def __init__(self, compiler: Any, xgrammar: Any) -> None:
        self._compiler, self._xgrammar = compiler, xgrammar

    def compile_json_schema(self, schema: str, **_: Any) -> Any:
        return self._compiler.compile_grammar(bounded_json_ebnf(json.loads(schema), self._xgrammar))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiler, name)
