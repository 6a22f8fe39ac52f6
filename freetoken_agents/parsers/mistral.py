"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` up to the end of the turn (v3:
Nemo, Mixtral); v11 (Small 3.2, Devstral) writes `[TOOL_CALLS]NAME[ARGS]{...}` per call
(`MistralV11Parser`, picked for a template that has `[ARGS]`)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from .base import (
    NamedCallParser,
    ParsedToolCall,
    ParseResult,
    ToolCallParser,
    load_arguments,
    name_args_schema,
)


class MistralParser(ToolCallParser):
    family = "mistral"
    start = "[TOOL_CALLS]"
    end = ""

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParseResult:
        i = text.find(self.start)
        if i < 0:
            return ParseResult(content=text.strip())
        content, body = text[:i], text[i + len(self.start) :].strip()
        try:
            value, _ = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            return ParseResult(content=content.strip(), partial=text[i:], partial_offset=i)
        items = value if isinstance(value, list) else [value]
        calls = []
        for item in items:
            raw = json.dumps(item)
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                error = "call has no 'name'"
                calls.append(ParsedToolCall(name="", arguments=raw, raw=raw, error=error, offset=i))
                continue
            args, error = item.get("arguments", {}), None
            if isinstance(args, str):
                args, error = load_arguments(args)
            calls.append(ParsedToolCall(name=item["name"], arguments=args, raw=raw, error=error, offset=i))
        return ParseResult(content=content.strip(), calls=calls)

    def call_prefix(self, name: str | None) -> str:
        return self.start + "["

    def call_suffix(self) -> str:
        return "]"

    def body_schema(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        return name_args_schema(tools)


_SPACE = re.compile(r"\s*")
_V11_CALL = re.compile(r"\[TOOL_CALLS\]([\w.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")


class MistralV11Parser(NamedCallParser):
    """Mistral v11 (Small 3.2, Devstral): `[TOOL_CALLS]NAME[ARGS]{...}` per call, the history's
    calls also carrying `[CALL_ID]ID` before `[ARGS]`; calls follow one another up to the turn's end."""

    family = "mistral_v11"
    label = "Mistral v11"
    start = "[TOOL_CALLS]"
    end = ""

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParseResult:
        i = text.find(self.start)
        if i < 0:
            return ParseResult(content=text.strip())
        content, calls, at = text[:i], [], i
        decoder = json.JSONDecoder()
        while at < len(text) and text.startswith(self.start, at):
            head = _V11_CALL.match(text, at)
            if head is None:
                return ParseResult(content=content.strip(), calls=calls, partial=text[at:], partial_offset=at)
            try:
                _, end = decoder.raw_decode(text, head.end())
            except json.JSONDecodeError:
                return ParseResult(content=content.strip(), calls=calls, partial=text[at:], partial_offset=at)
            args, error = load_arguments(text[head.end() : end])
            calls.append(
                ParsedToolCall(name=head.group(1), arguments=args, raw=text[at:end], error=error, offset=at)
            )
            at = _SPACE.match(text, end).end()
        return ParseResult(content=(content + text[at:]).strip(), calls=calls)

    def named_prefix(self, name: str) -> str:
        return f"{self.start}{name}[ARGS]"

    def call_suffix(self) -> str:
        return ""
