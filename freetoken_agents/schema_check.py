"""What a JSON schema may cost before the grammar compiler sees it, and whether it has a value.

Schemas come from callers we do not trust (an OpenAI client's `tools` and `response_format`, a
LangChain user's structured output), and the compiler's cost grows much faster than a schema's
size: on the embedded model's vocabulary an `enum` of 20,000 strings took 9.3 CPU-s to compile
and an object of 5,000 optional properties 158 CPU-s, while 1,000 properties took 0.9 s and 4,096
enum entries 0.05 s. `check_schema` walks the schema once, in time linear in its size and without
recursion (a 10,000-deep schema is a refusal, not a RecursionError), and raises `SchemaRejected`
past the limits below.

It also refuses what the compiler would accept and then never finish: a `$ref` cycle that every
value must follow (`{"$defs": {"n": {"properties": {"next": {"$ref": "#/$defs/n"}}, "required":
["next"]}}}` has no finite JSON value: jump-forward decoding of it grew without bound until the
kernel killed the process). Recursion with a way out (an optional property, an array that may be
empty, an `anyOf` branch that ends) is allowed. Only local references (`#`, `#/...`) are
supported; anything else is refused here with its one-line reason.

And it bounds what makes one compile slow without making the schema large (measured on the
embedded model's vocabulary, one thread): a `pattern`'s bounded repetitions (`(a|b){1,20000}`, a
380-byte tool schema, compiled for more than 90 s; `regex_cost` estimates the copies the compiler
makes), `format`s (each a fixed regex: 256 `"format": "uri"` took 0.9 s) and number ranges (a
regex per range, growing with the bounds' digits: `[-1e300, 1e300]` took 54 ms), summed over the
whole schema into `MAX_GRAMMAR_COST`; and the literal text the grammar must spell out (enum and
const values, property names: a 30,000-character `const` took 0.8 s, 100,000 took 4.7 s).
`minLength`/`maxLength`/`minItems`/`maxItems`/`minProperties`/`maxProperties` cost nothing to
compile whatever their size (counted, not expanded: 10^8 compiled in 1 ms) and are not bounded.
A schema at every limit at once (patterns, const and enum text) compiled in 0.67 s there;
the compiler's time also grows with the vocabulary (a pattern's broad class such as `.` or
`[a-z]` costs per state about 0.2 us per token of the vocabulary), which the server bounds with a
deadline on the compile itself (`GrammarFactory.precompile`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from .errors import SchemaRejected
from .regex_cost import PatternTooCostly, pattern_states

MAX_NODES = 10_000  # JSON values in the schema (objects, arrays, strings, numbers...)
MAX_DEPTH = 64  # nesting of the schema's JSON
MAX_PROPERTIES = 256  # properties of one object schema
MAX_ENUM = 4_096  # `enum` entries in the whole schema
MAX_REFS = 64  # distinct `$ref` targets
MAX_REF_WORK = 200_000  # values visited while checking that the refs let a value end
MAX_PATTERN_LENGTH = 1_000  # characters of one regex (`pattern`, a `patternProperties` key)
# States one regex may expand to (`regex_cost`): `a{1,500}` compiled in 27 ms, and an email
# pattern `^[a-z0-9._%+-]{1,64}@[a-z0-9.-]{1,255}\.[a-z]{2,63}$` counts 386.
MAX_PATTERN_STATES = 500
# The compile cost of the whole schema, in units of about a regex state (~0.03 ms): its patterns'
# states, FORMAT_COST per `format`, RANGE_COST per number range plus its bounds' digits. At the
# limit: 20 patterns of 500 states compiled in 0.27 s, 200 `"format": "uri"` in 0.39 s, 16
# ranges [-1e300, 1e300] in 0.37 s.
MAX_GRAMMAR_COST = 10_000
FORMAT_COST = 50  # `"format": "uri"` compiled in 3.5 ms, "email" in 1.5 ms
RANGE_COST = 20  # a number range's regex, before its bounds' digits: [0, 1e6] took 5 ms
# Characters of enum and const values and property names, which the grammar spells out: a
# 16,384-character const compiled in 0.29 s, 16,384 of enum values in about 0.1 s. A property
# name's count twice: they cost more (256 optional properties of 32 characters took 0.32 s).
MAX_LITERAL_CHARS = 16_384

__all__ = [
    "FORMAT_COST",
    "MAX_DEPTH",
    "MAX_ENUM",
    "MAX_GRAMMAR_COST",
    "MAX_LITERAL_CHARS",
    "MAX_NODES",
    "MAX_PATTERN_LENGTH",
    "MAX_PATTERN_STATES",
    "MAX_PROPERTIES",
    "MAX_REFS",
    "RANGE_COST",
    "check_schema",
]

_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# keywords whose value maps names to schemas: its keys are names, not keywords (a property named
# "enum" or "pattern" is a schema like any other)
_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})

# where a value sits in the schema: (parent, key) links, rendered only for an error message
_Path = tuple[Any, str] | None


def check_schema(schema: Any) -> None:
    """SchemaRejected (one line) when `schema` is over the limits above, refers to what is not in
    it, or has no finite value; returns None when the grammar compiler may have it."""
    if not isinstance(schema, dict):
        raise SchemaRejected(f"a JSON schema must be an object, got {type(schema).__name__}")
    refs = _walk(schema)
    _check_refs(schema, refs)


class _Cost:
    """What the walk adds up: enum entries, literal characters, compile cost."""

    def __init__(self) -> None:
        self.enums = self.literal = self.grammar = 0

    def text(self, chars: int) -> None:
        self.literal += chars
        if self.literal > MAX_LITERAL_CHARS:
            raise SchemaRejected(
                f"the JSON schema's enum and const values and property names (counted twice) hold "
                f"more than {MAX_LITERAL_CHARS} characters"
            )

    def compile(self, cost: int, path: _Path) -> None:
        self.grammar += cost
        if self.grammar > MAX_GRAMMAR_COST:
            raise SchemaRejected(
                f"the JSON schema's patterns, formats and number ranges would cost more than "
                f"{MAX_GRAMMAR_COST} units to compile (passed at {_render(path)})"
            )


def _walk(schema: dict[str, Any]) -> set[str]:
    """Count and bound the schema's values and their compile cost (iteratively); the `$ref`
    strings it uses. A value under `enum` or `const` is literal text, not a schema."""
    nodes = 0
    cost = _Cost()
    refs: set[str] = set()
    # (value, depth, path, what it is: "schema", "map" (of names to schemas), "literal" (text the
    # grammar spells out) or "data" (a default or example: not compiled))
    stack: list[tuple[Any, int, _Path, str]] = [(schema, 1, None, "schema")]
    while stack:
        value, depth, path, kind = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise SchemaRejected(f"the JSON schema has more than {MAX_NODES} values")
        if depth > MAX_DEPTH:
            raise SchemaRejected(f"the JSON schema is nested deeper than {MAX_DEPTH} levels")
        if kind == "literal":
            _literal(value, cost)
        elif kind == "schema" and isinstance(value, dict):
            _node(value, path, cost, refs)
        if isinstance(value, dict):
            for key, item in value.items():
                stack.append((item, depth + 1, (path, str(key)), _kind(kind, key)))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, (path, str(k)), kind) for k, item in enumerate(value))
    return refs


def _kind(parent: str, key: Any) -> str:
    """What the value under `key` of a `parent` object is (see `_walk`)."""
    if parent != "schema":
        return "schema" if parent == "map" else parent  # a map's values are schemas
    if key in ("enum", "const"):
        return "literal"
    if key in ("default", "examples"):
        return "data"
    return "map" if key in _MAPS else "schema"


def _node(value: dict[str, Any], path: _Path, cost: _Cost, refs: set[str]) -> None:
    """Bound one object of the schema (a schema, or a map of them such as `properties`)."""
    properties = value.get("properties")
    if isinstance(properties, dict):
        if len(properties) > MAX_PROPERTIES:
            raise SchemaRejected(
                f"an object schema has {len(properties)} properties; at most {MAX_PROPERTIES}"
            )
        cost.text(2 * sum(len(str(name)) for name in properties))
    enum = value.get("enum")
    if isinstance(enum, list):
        cost.enums += len(enum)
        if cost.enums > MAX_ENUM:
            raise SchemaRejected(f"the JSON schema has more than {MAX_ENUM} enum entries")
    ref = value.get("$ref")
    if ref is not None:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaRejected(f"$ref {str(ref)[:80]!r} is not supported: only local refs '#/...'")
        refs.add(ref)
    pattern = value.get("pattern")
    if isinstance(pattern, str):
        cost.compile(_pattern(pattern, (path, "pattern")), path)
    pattern_properties = value.get("patternProperties")
    if isinstance(pattern_properties, dict):
        for regex in pattern_properties:
            cost.compile(_pattern(str(regex), ((path, "patternProperties"), str(regex))), path)
    if isinstance(value.get("format"), str):
        cost.compile(FORMAT_COST, path)
    bounds = [value[key] for key in _BOUNDS if key in value]
    if any(isinstance(b, int | float) and not isinstance(b, bool) for b in bounds):
        cost.compile(RANGE_COST + sum(_digits(b, path) for b in bounds), path)


def _pattern(regex: str, path: _Path) -> int:
    """The states of one regex (`regex_cost`), or SchemaRejected naming where it is."""
    if len(regex) > MAX_PATTERN_LENGTH:
        raise SchemaRejected(
            f"the regex at {_render(path)} is {len(regex)} characters long; at most {MAX_PATTERN_LENGTH}"
        )
    try:
        return pattern_states(regex, MAX_PATTERN_STATES)
    except PatternTooCostly as e:
        shown = regex if len(regex) <= 60 else regex[:57] + "..."
        raise SchemaRejected(
            f"the regex at {_render(path)} ({shown!r}) {e}; at most {MAX_PATTERN_STATES}: "
            "lower its repetition bounds ({m,n})"
        ) from None


def _digits(bound: Any, path: _Path) -> int:
    """Decimal digits of a range bound's integer part (without converting a huge int to text:
    past 4,300 digits that is a ValueError); 0 for what is not a number."""
    if isinstance(bound, bool) or not isinstance(bound, int | float):
        return 0
    if isinstance(bound, float) and not math.isfinite(bound):
        raise SchemaRejected(f"a number bound at {_render(path)} is {bound}, not a finite number")
    magnitude = abs(int(bound))
    return int(magnitude.bit_length() * math.log10(2)) + 1


def _literal(value: Any, cost: _Cost) -> None:
    """Count the characters one value of an enum or const spells out in the grammar."""
    if isinstance(value, str):
        cost.text(len(value))
    elif isinstance(value, dict):
        cost.text(sum(len(str(key)) for key in value))
    elif isinstance(value, int | float) and not isinstance(value, bool):
        cost.text(_digits(value, None) if not isinstance(value, float) or math.isfinite(value) else 3)


def _render(path: _Path) -> str:
    """'properties.code.pattern' for the path links (the schema's root: '#')."""
    parts: list[str] = []
    while path is not None:
        path, key = path
        parts.append(key)
    return ".".join(reversed(parts)) or "#"


def _resolve(schema: dict[str, Any], ref: str) -> Any:
    """The value JSON pointer `ref` ('#/a/b', with ~0 ~1 escapes) names in `schema`."""
    node: Any = schema
    for part in ref[2:].split("/") if ref != "#" else []:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise SchemaRejected(f"$ref {ref[:80]!r} names nothing in the schema")
    return node


def _check_refs(schema: dict[str, Any], refs: set[str]) -> None:
    """Every ref resolves, and the schema has a finite value: which refs can end is a least
    fixpoint (a ref ends once its target can, assuming only refs already known to end)."""
    if len(refs) > MAX_REFS:
        raise SchemaRejected(f"the JSON schema uses more than {MAX_REFS} distinct $ref targets")
    targets = {ref: _resolve(schema, ref) for ref in sorted(refs)}
    finite = _Finite(dict.fromkeys(targets, False))
    changed = True
    while changed:
        changed = False
        for ref, target in targets.items():
            if not finite.ends[ref] and finite(target):
                finite.ends[ref] = changed = True
    if not finite(schema):
        loop = next((ref for ref in targets if not finite.ends[ref]), "#")
        raise SchemaRejected(
            f"the JSON schema has no finite value: every value of {loop!r} must contain another "
            "(make the recursion optional)"
        )


class _Finite:
    """`finite(node)`: whether `node` has a finite value, given `ends` (which refs are known to
    have one). Follows the schema's own nesting (bounded by `_walk`), never a ref; the work of all
    calls together is bounded by `MAX_REF_WORK` values visited."""

    def __init__(self, ends: dict[str, bool]) -> None:
        self.ends, self.work = ends, 0

    def __call__(self, node: Any) -> bool:
        self.work += 1
        if self.work > MAX_REF_WORK:
            raise SchemaRejected("the JSON schema's $ref structure is too complex to check")
        if node is False:
            return False
        if not isinstance(node, dict):
            return True
        if "$ref" in node and not self.ends.get(node["$ref"], False):
            return False
        if not all(self(s) for s in _list(node.get("allOf"))):
            return False
        for key in ("anyOf", "oneOf"):
            if key in node and not any(self(s) for s in _list(node.get(key))):
                return False
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if not all(self(properties[name]) for name in _required(node) if name in properties):
            return False
        need = node.get("minItems", 0)
        need = need if isinstance(need, int) and need > 0 else 0
        prefix = _list(node.get("prefixItems"))
        if not all(self(s) for s in prefix[:need]):
            return False
        return need <= len(prefix) or self(node.get("items", True))


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _required(node: dict[str, Any]) -> Iterator[str]:
    return (name for name in _list(node.get("required")) if isinstance(name, str))
