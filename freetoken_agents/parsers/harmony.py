"""gpt-oss harmony: `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>{...}<|call|>` (the leading `<|start|>assistant` may be part of the prompt)."""

from __future__ import annotations

import re
from typing import Any

from .base import ParsedToolCall, ParseResult, ToolCallParser, load_arguments, tools_by_name

_CALL = re.compile(
    r"<\|channel\|>commentary to=functions\.([\w.\-]+)\s*"
    r"(?:<\|constrain\|>\s*\w+)?\s*<\|message\|>(.*?)<\|call\|>",
    re.S,
)
_FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.S)


class HarmonyParser(ToolCallParser):
    family = "harmony"
    start = "<|channel|>commentary to=functions."
    end = "<|call|>"

    def parse(self, text: str) -> ParseResult:
        calls, pieces, last = [], [], 0
        for m in _CALL.finditer(text):
            args, error = load_arguments(m.group(2))
            raw, offset = m.group(0), m.start()
            calls.append(ParsedToolCall(name=m.group(1), arguments=args, raw=raw, error=error, offset=offset))
            pieces.append(text[last : m.start()])
            last = m.end()
        tail = text[last:]
        partial = partial_offset = None
        i = tail.find(self.start)
        if i >= 0:
            tail, partial, partial_offset = tail[:i], tail[i:], last + i
        rest = "".join(pieces) + tail
        final = _FINAL.search(rest)
        content = final.group(1) if final else re.sub(r"<\|[a-z]+\|>", "", rest)
        return ParseResult(
            content=content.strip(), calls=calls, partial=partial, partial_offset=partial_offset
        )

    def needs_name_in_prefix(self) -> bool:
        return True

    def call_prefix(self, name: str | None) -> str:
        if name is None:
            raise ValueError("harmony calls name the tool before the arguments: pass a tool name")
        return f"{self.start}{name} <|constrain|>json<|message|>"

    def call_suffix(self) -> str:
        return self.end

    def body_schema(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        (params,) = tools_by_name(tools).values()
        return params
