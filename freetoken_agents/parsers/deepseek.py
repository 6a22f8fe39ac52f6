"""DeepSeek-V3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`."""

from __future__ import annotations

import re
from typing import Any

from .base import ParsedToolCall, ParseResult, ToolCallParser, load_arguments, split_blocks, tools_by_name

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(r"^\s*(?:function)?" + re.escape(SEP) + r"([^\n]+)\n```(?:json)?\n(.*?)\n```\s*$", re.S)


class DeepSeekParser(ToolCallParser):
    family = "deepseek"
    start = CALLS_BEGIN
    end = CALLS_END

    def parse(self, text: str) -> ParseResult:
        content, groups, partial = split_blocks(text, CALLS_BEGIN, CALLS_END)
        calls = []
        for group in groups:
            inner, blocks, open_call = split_blocks(group, CALL_BEGIN, CALL_END)
            for raw in blocks:
                m = _CALL.match(raw)
                if not m:
                    calls.append(ParsedToolCall(name="", arguments=raw, raw=raw, error="call is malformed"))
                    continue
                args, error = load_arguments(m.group(2))
                calls.append(ParsedToolCall(name=m.group(1).strip(), arguments=args, raw=raw, error=error))
            if open_call:
                partial = open_call
        return ParseResult(content=content.strip(), calls=calls, partial=partial)

    def needs_name_in_prefix(self) -> bool:
        return True

    def call_prefix(self, name: str | None) -> str:
        if name is None:
            raise ValueError("DeepSeek calls name the tool before the arguments: pass a tool name")
        return f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}{name}\n```json\n"

    def call_suffix(self) -> str:
        return f"\n```{CALL_END}{CALLS_END}"

    def body_schema(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        (params,) = tools_by_name(tools).values()
        return params
