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
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .errors import SchemaRejected

MAX_NODES = 10_000  # JSON values in the schema (objects, arrays, strings, numbers...)
MAX_DEPTH = 64  # nesting of the schema's JSON
MAX_PROPERTIES = 256  # properties of one object schema
MAX_ENUM = 4_096  # `enum` entries in the whole schema
MAX_REFS = 64  # distinct `$ref` targets
MAX_REF_WORK = 200_000  # values visited while checking that the refs let a value end

__all__ = ["MAX_DEPTH", "MAX_ENUM", "MAX_NODES", "MAX_PROPERTIES", "MAX_REFS", "check_schema"]


def check_schema(schema: Any) -> None:
    """SchemaRejected (one line) when `schema` is over the limits above, refers to what is not in
    it, or has no finite value; returns None when the grammar compiler may have it."""
    if not isinstance(schema, dict):
        raise SchemaRejected(f"a JSON schema must be an object, got {type(schema).__name__}")
    refs = _walk(schema)
    _check_refs(schema, refs)


def _walk(schema: dict[str, Any]) -> set[str]:
    """Count and bound the schema's values (iteratively); the `$ref` strings it uses."""
    nodes = enums = 0
    refs: set[str] = set()
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise SchemaRejected(f"the JSON schema has more than {MAX_NODES} values")
        if depth > MAX_DEPTH:
            raise SchemaRejected(f"the JSON schema is nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            properties = value.get("properties")
            if isinstance(properties, dict) and len(properties) > MAX_PROPERTIES:
                raise SchemaRejected(
                    f"an object schema has {len(properties)} properties; at most {MAX_PROPERTIES}"
                )
            enum = value.get("enum")
            if isinstance(enum, list):
                enums += len(enum)
                if enums > MAX_ENUM:
                    raise SchemaRejected(f"the JSON schema has more than {MAX_ENUM} enum entries")
            ref = value.get("$ref")
            if ref is not None:
                if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
                    raise SchemaRejected(f"$ref {str(ref)[:80]!r} is not supported: only local refs '#/...'")
                refs.add(ref)
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return refs


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
