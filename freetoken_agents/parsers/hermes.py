"""Hermes / Qwen: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (the engine default)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .base import ParsedToolCall, ParseResult, ToolCallParser, load_arguments, name_args_schema, split_blocks


class HermesParser(ToolCallParser):
    family = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParseResult:
        found = split_blocks(text, self.start, self.end)
        calls = []
        for offset, raw in found.blocks:
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                error = f"call is not JSON: {e.msg}"
                calls.append(ParsedToolCall(name="", arguments=raw, raw=raw, error=error, offset=offset))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                error = "call has no 'name'"
                calls.append(ParsedToolCall(name="", arguments=raw, raw=raw, error=error, offset=offset))
                continue
            args = obj.get("arguments", obj.get("parameters", {}))
            error = None
            if isinstance(args, str):
                args, error = load_arguments(args)
            elif not isinstance(args, dict):
                args, error = json.dumps(args), "arguments must be a JSON object"
            calls.append(
                ParsedToolCall(name=obj["name"], arguments=args, raw=raw, error=error, offset=offset)
            )
        return ParseResult(
            content=found.rest.strip(),
            calls=calls,
            partial=found.partial,
            partial_offset=found.partial_offset,
        )

    def call_prefix(self, name: str | None) -> str:
        return self.start + "\n"

    def call_suffix(self) -> str:
        return "\n" + self.end

    def body_schema(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        return name_args_schema(tools)
