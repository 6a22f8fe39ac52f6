"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` up to the end of the turn."""

from __future__ import annotations

import json
from typing import Any

from .base import ParsedToolCall, ParseResult, ToolCallParser, load_arguments, name_args_schema


class MistralParser(ToolCallParser):
    family = "mistral"
    start = "[TOOL_CALLS]"
    end = ""

    def parse(self, text: str) -> ParseResult:
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
