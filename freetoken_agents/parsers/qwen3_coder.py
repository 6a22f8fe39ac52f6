"""Qwen3-Coder (also Qwen3.5, Nemotron 3 Nano, Step 3.5): XML calls, one parameter per tag:

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

The template writes a string value as its raw text, an object or a list as JSON (`tojson`) and any
other value through Jinja's `string` filter (`6`, `1.5`, `True`, `None`). So a value's type is not
in the text: it is read back by the tool's JSON schema (the `tools` given to `parse`, those of the
request) — a string parameter keeps the raw text, the others parse as JSON (the template's
`True` / `False` / `None` too); a parameter whose type is unknown is JSON when it parses, else the
text. `xml_parameters` is what the constrained decoder builds its grammar from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .base import NamedCallParser, ParsedToolCall, ParseResult, split_blocks, tools_by_name

FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
VALUE_END = f"\n{PARAMETER_END}\n"
"""What closes a value: the template writes `<parameter=P>\\n` VALUE `\\n</parameter>\\n`."""

_BLANK = re.compile(r"\s*")
_HEAD = re.compile(r"\s*<function=([^>\n]+)>")


@dataclass(frozen=True)
class XmlParameter:
    """One parameter of a tool as the XML body writes it. `raw`: its value is written as text (a
    string may be), not JSON; `schema`: its JSON schema, the tool's `$defs` attached."""

    name: str
    required: bool
    raw: bool
    schema: dict[str, Any]


def xml_parameters(parameters: dict[str, Any]) -> list[XmlParameter]:
    """A tool's parameters (its JSON schema) in the order the schema declares them."""
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    required = set(parameters.get("required") or ())
    out = []
    for name, schema in (parameters.get("properties") or {}).items():
        schema = schema if isinstance(schema, dict) else {}
        types = value_types(schema, parameters)
        raw = types is None or "string" in types
        out.append(XmlParameter(name, name in required, raw, {**schema, **defs} if defs else schema))
    return out


def value_types(schema: Any, root: dict[str, Any]) -> frozenset[str] | None:
    """The JSON types `schema` allows at its top (None: unknown, any value). Local `$ref`s are
    followed, `anyOf` / `oneOf` united, `enum` / `const` typed by their values."""
    for _ in range(16):  # a chain of references; a loop of them is "unknown"
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#/"):
            break
        schema = root
        for part in ref[2:].split("/"):
            schema = schema.get(part, {}) if isinstance(schema, dict) else {}
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return frozenset({kind})
    if isinstance(kind, list):
        return frozenset(k for k in kind if isinstance(k, str))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            members = [value_types(s, root) for s in schema[key]]
            return None if any(m is None for m in members) else frozenset().union(*members)
    values = schema["enum"] if isinstance(schema.get("enum"), list) else None
    if values is None and "const" in schema:
        values = [schema["const"]]
    return frozenset(_json_type(v) for v in values) if values is not None else None


def read_value(text: str, types: frozenset[str] | None) -> Any:
    """A parameter's value from its text, by the JSON types its schema allows (`value_types`)."""
    if types is not None and "null" in types and text in ("null", "None"):
        return None
    if types is not None and "boolean" in types and text in ("True", "False"):
        return text == "True"  # the template's `string` filter writes Python's booleans
    if types == {"string"} or types == {"string", "null"}:
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text  # a value of the wrong type: the arguments' validation says so to the model
    if types is not None and "string" in types and not _allowed(value, types - {"string"}):
        return text  # text that happens to be JSON, for a parameter that takes text
    return value


class Qwen3CoderParser(NamedCallParser):
    family = "qwen3_coder"
    label = "Qwen3-Coder"
    start = "<tool_call>"
    end = "</tool_call>"
    body_format = "xml_parameters"

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParseResult:
        found = split_blocks(text, self.start, self.end)
        schemas = tools_by_name(list(tools or []))
        calls = []
        for offset, raw in found.blocks:
            name, arguments, error = self._call(raw, schemas)
            calls.append(ParsedToolCall(name=name, arguments=arguments, raw=raw, error=error, offset=offset))
        return ParseResult(
            content=found.rest.strip(),
            calls=calls,
            partial=found.partial,
            partial_offset=found.partial_offset,
        )

    def _call(
        self, raw: str, schemas: dict[str, dict[str, Any]]
    ) -> tuple[str, dict[str, Any] | str, str | None]:
        """(name, arguments, error) of one call's text (inside `<tool_call>...</tool_call>`);
        `schemas`: each offered tool's parameters, by name."""
        head = _HEAD.match(raw)
        if head is None:
            return "", raw, f"call has no '{FUNCTION}NAME>'"
        name = head.group(1).strip()
        params = schemas.get(name, {})
        properties = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        arguments: dict[str, Any] = {}
        at = head.end()
        while True:
            at = _BLANK.match(raw, at).end()
            if raw.startswith(FUNCTION_END, at):
                break
            if not raw.startswith(PARAMETER, at):
                return name, raw, f"expected '{PARAMETER}' or '{FUNCTION_END}' at {raw[at : at + 20]!r}"
            close = raw.find(">", at)
            end = raw.find(PARAMETER_END, at)
            if close < 0 or end < 0 or end < close:
                return name, raw, f"parameter at {raw[at : at + 20]!r} is not closed"
            key, value = raw[at + len(PARAMETER) : close].strip(), raw[close + 1 : end]
            if key in arguments:
                return name, raw, f"parameter {key!r} is given twice"
            value = value.removeprefix("\n").removesuffix("\n")  # the template's own newlines
            arguments[key] = read_value(value, value_types(properties.get(key, {}), params))
            at = end + len(PARAMETER_END)
        if raw[at + len(FUNCTION_END) :].strip():
            return name, raw, f"text after '{FUNCTION_END}'"
        return name, arguments, None

    def named_prefix(self, name: str) -> str:
        return f"{self.start}\n{FUNCTION}{name}>\n"

    def call_suffix(self) -> str:
        return f"\n{self.end}"  # the body (the grammar's) ends with </function>

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        """A call as the template writes one (values: strings raw, objects and lists as JSON)."""
        body = "".join(f"{PARAMETER}{k}>\n{_written(v)}{VALUE_END}" for k, v in arguments.items())
        return f"{self.named_prefix(name)}{body}{FUNCTION_END}{self.call_suffix()}"


def _written(value: Any) -> str:
    """A value as the template's `tojson` / `string` filters write it."""
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _allowed(value: Any, types: frozenset[str]) -> bool:
    kind = _json_type(value)
    return kind in types or (kind == "integer" and "number" in types)
