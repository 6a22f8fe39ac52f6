"""DeepSeek-V3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; DeepSeek-V3.1 and later drop the type and the code fence:
`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`. Both forms are parsed; a call is
written in the form of the model's own template (`DeepSeekV31Parser` when it has no
`function<｜tool▁sep｜>`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .base import (
    NamedCallParser,
    ParsedToolCall,
    ParseResult,
    load_arguments,
    split_blocks,
)

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(r"^\s*(?:function)?" + re.escape(SEP) + r"([^\n]+)\n```(?:json)?\n(.*?)\n```\s*$", re.S)
_CALL_V31 = re.compile(r"^\s*([^\s<]+)\s*" + re.escape(SEP) + r"(.*?)\s*$", re.S)


class DeepSeekParser(NamedCallParser):
    family = "deepseek"
    label = "DeepSeek"
    start = CALLS_BEGIN
    end = CALLS_END

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParseResult:
        groups = split_blocks(text, CALLS_BEGIN, CALLS_END)
        partial, partial_offset = groups.partial, groups.partial_offset
        calls = []
        for offset, group in groups.blocks:
            inner = split_blocks(group, CALL_BEGIN, CALL_END)
            for _, raw in inner.blocks:
                m = _CALL.match(raw) or _CALL_V31.match(raw)
                if not m:
                    error = "call is malformed"
                    calls.append(ParsedToolCall(name="", arguments=raw, raw=raw, error=error, offset=offset))
                    continue
                args, error = load_arguments(m.group(2))
                name = m.group(1).strip()
                calls.append(ParsedToolCall(name=name, arguments=args, raw=raw, error=error, offset=offset))
            if inner.partial:
                partial, partial_offset = inner.partial, offset
        return ParseResult(
            content=groups.rest.strip(), calls=calls, partial=partial, partial_offset=partial_offset
        )

    def named_prefix(self, name: str) -> str:
        return f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}{name}\n```json\n"

    def call_suffix(self) -> str:
        return f"\n```{CALL_END}{CALLS_END}"


class DeepSeekV31Parser(DeepSeekParser):
    """DeepSeek-V3.1 and later: the name right after the call marker, the JSON arguments unfenced."""

    family = "deepseek_v31"

    def named_prefix(self, name: str) -> str:
        return f"{CALLS_BEGIN}{CALL_BEGIN}{name}{SEP}"

    def call_suffix(self) -> str:
        return f"{CALL_END}{CALLS_END}"
