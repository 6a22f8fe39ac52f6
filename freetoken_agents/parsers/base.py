"""Tool-call parsing: one parser per chat-template family over one small interface."""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field


class ParsedToolCall(BaseModel):
    """A complete tool call found in model text. `arguments` is a dict, or the raw string when it
    was not valid JSON (validation then fails with a message the model sees)."""

    name: str
    arguments: dict[str, Any] | str
    raw: str = ""
    error: str | None = Field(default=None, description="why the call is malformed, if it is")
    offset: int = Field(
        default=0,
        description="index in the parsed text where the call's text starts (its marker; for a "
        "list of calls behind one marker, the marker's)",
    )


class ParseResult(BaseModel):
    """The parse of one assistant turn."""

    content: str = Field(description="text outside tool calls")
    calls: list[ParsedToolCall] = Field(default_factory=list)
    partial: str | None = Field(default=None, description="an unterminated call's text, if any")
    partial_offset: int | None = Field(default=None, description="where the unterminated call starts")

    @property
    def malformed(self) -> list[ParsedToolCall]:
        return [c for c in self.calls if c.error]


class ToolCallParser(ABC):
    """Parses one family's tool-call format.

    `start` / `end` are the markers of one call; `call_prefix(name)` and `call_suffix()` are the
    text the agent forces around constrained arguments; `body_schema(tools)` is the JSON schema of
    the text between them.
    """

    family: str = ""
    start: str = ""
    end: str = ""
    body_format: str = "json"
    """What a call's body is, for the constrained decoder: "json" (one JSON value under
    `body_schema`) or "xml_parameters" (Qwen3-Coder's `<parameter=P>` tags, `qwen3_coder`)."""

    @abstractmethod
    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParseResult:
        """The calls in `text` and the content around them. `tools`: the tools the request
        offered, for a family whose text does not say a value's type (Qwen3-Coder's XML
        parameters are typed by their schemas); the others read types from the text."""

    @abstractmethod
    def call_prefix(self, name: str | None) -> str: ...

    @abstractmethod
    def call_suffix(self) -> str: ...

    @abstractmethod
    def body_schema(self, tools: list[dict[str, Any]]) -> dict[str, Any]: ...

    def needs_name_in_prefix(self) -> bool:
        """True when the call's name is part of the prefix (the body holds only arguments)."""
        return False

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        """A complete call to `name` in this family's text, as `parse` reads it back."""
        body = json.dumps(arguments, ensure_ascii=False)
        if not self.needs_name_in_prefix():
            body = f'{{"name": {json.dumps(name)}, "arguments": {body}}}'
        return self.call_prefix(name) + body + self.call_suffix()

    def call_started(self, text: str, since: int = 0) -> int | None:
        """Index in `text` where a tool call starts, or None. Only a marker ending after index
        `since` counts, so a streamer that passes the length it searched last time does O(new
        text) work per call instead of rescanning the whole turn."""
        i = text.find(self.start, max(0, since - len(self.start) + 1))
        return i if i >= 0 else None

    def held_back(self, text: str) -> int:
        """Length of the suffix of `text` that could be the start of a call marker."""
        return marker_prefix_at_end(text, self.start)


def marker_prefix_at_end(text: str, marker: str) -> int:
    """Length of the longest proper prefix of `marker` that `text` ends with (0: none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class NamedCallParser(ToolCallParser):
    """A family whose call prefix names the tool (harmony, DeepSeek, Mistral v11): the body holds
    only the arguments, under that one tool's parameters. `label` names the family in errors."""

    label = ""

    def needs_name_in_prefix(self) -> bool:
        return True

    def call_prefix(self, name: str | None) -> str:
        if name is None:
            raise ValueError(f"{self.label} calls name the tool before the arguments: pass a tool name")
        return self.named_prefix(name)

    @abstractmethod
    def named_prefix(self, name: str) -> str:
        """The text before a call's arguments to the tool `name`."""

    def body_schema(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        (params,) = tools_by_name(tools).values()
        return params


def load_arguments(raw: str) -> tuple[dict[str, Any] | str, str | None]:
    """JSON object text -> (dict, None), or (raw, error) when it is not a JSON object."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        return raw, f"arguments are not valid JSON: {e.msg} at position {e.pos}"
    if not isinstance(value, dict):
        return raw, f"arguments must be a JSON object, got {type(value).__name__}"
    return value, None


class Blocks(BaseModel):
    """`start..end` blocks found in a text (see `split_blocks`)."""

    rest: str = Field(description="the text outside complete blocks, up to an unterminated one")
    blocks: list[tuple[int, str]] = Field(description="(offset of the block's start marker, inside)")
    partial: str | None = Field(default=None, description="an unterminated block's text")
    partial_offset: int | None = None


def split_blocks(text: str, start: str, end: str) -> Blocks:
    """Split `text` into complete `start..end` blocks, the text outside them and an unterminated
    block (offsets index `text`)."""
    pattern = re.compile(re.escape(start) + r"(.*?)" + re.escape(end), re.S)
    blocks, pieces, last = [], [], 0
    for m in pattern.finditer(text):
        blocks.append((m.start(), m.group(1)))
        pieces.append(text[last : m.start()])
        last = m.end()
    tail = text[last:]
    partial = partial_offset = None
    i = tail.find(start)
    if i >= 0:
        tail, partial, partial_offset = tail[:i], tail[i:], last + i
    return Blocks(rest="".join(pieces) + tail, blocks=blocks, partial=partial, partial_offset=partial_offset)


def tools_by_name(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for t in tools:
        fn = t.get("function", t)
        out[fn["name"]] = fn.get("parameters") or {"type": "object", "properties": {}}
    return out


def name_args_schema(tools: list[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    """Schema of {"name": <one of tools>, "<args_key>": <that tool's parameters>}."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, args_key: params},
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for name, params in tools_by_name(tools).items()
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}
