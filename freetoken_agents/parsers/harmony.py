"""gpt-oss harmony: `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json
<|message|>{...}<|call|>` (the leading `<|start|>assistant` may be part of the prompt). The
recipient may also stand in the role header, as gpt-oss's own template writes past calls:
`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>`; both
forms are parsed and detected, and calls are written in the first.

`<|call|>` is one of gpt-oss's end-of-turn tokens (its generation_config.json lists it): a decoder
that stops on it, here or on an OpenAI-compatible server, leaves it out of the text. A call that
runs to the end of the text is therefore taken as ended there when its arguments are a complete
JSON object; one whose arguments are not (cut short) stays an unterminated `partial`."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .base import (
    NamedCallParser,
    ParsedToolCall,
    ParseResult,
    load_arguments,
    marker_prefix_at_end,
)

_HEAD = (  # a call's header in either form, up to its arguments
    r"(?:<\|channel\|>commentary\s+to=functions\.(?P<name>[\w.\-]+)"
    r"|to=functions\.(?P<header_name>[\w.\-]+)\s*<\|channel\|>commentary)\s*"
    r"(?:<\|constrain\|>)?\s*(?:\w+)?\s*<\|message\|>"
)
_CALL = re.compile(_HEAD + r"(?P<args>.*?)<\|call\|>", re.S)
_STOPPED = re.compile(_HEAD + r"(?P<args>.*)", re.S)  # a call whose `<|call|>` was a stop token
_HEADER = "to=functions."  # the recipient in the role header
_ANALYSIS = re.compile(r"<\|channel\|>analysis<\|message\|>.*?(?:<\|end\|>|$)", re.S)
_HEADERS = re.compile(r"<\|start\|>assistant|<\|channel\|>\w+|<\|[a-z]+\|>")


def _plain(text: str) -> str:
    """Text outside calls without a final channel: analysis messages (the model's reasoning) and
    harmony's role and channel headers dropped."""
    return _HEADERS.sub("", _ANALYSIS.sub("", text))


_FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.S)


def _call(m: re.Match[str], offset: int) -> ParsedToolCall:
    args, error = load_arguments(m.group("args"))
    name = m.group("name") or m.group("header_name")
    return ParsedToolCall(name=name, arguments=args, raw=m.group(0), error=error, offset=offset)


class HarmonyParser(NamedCallParser):
    family = "harmony"
    label = "harmony"
    start = "<|channel|>commentary to=functions."
    end = "<|call|>"

    def parse(self, text: str, tools: Sequence[dict[str, Any]] | None = None) -> ParseResult:
        calls, pieces, last = [], [], 0
        for m in _CALL.finditer(text):
            calls.append(_call(m, m.start()))
            pieces.append(text[last : m.start()])
            last = m.end()
        tail = text[last:]
        partial = partial_offset = None
        i = self.call_started(tail)
        if i is not None:
            stopped = _STOPPED.fullmatch(tail, i)
            call = _call(stopped, last + i) if stopped is not None else None
            if call is not None and call.error is None:  # its `<|call|>` was the stop token
                calls.append(call)
            else:
                partial, partial_offset = tail[i:], last + i
            tail = tail[:i]
        rest = "".join(pieces) + tail
        final = _FINAL.search(rest)
        content = final.group(1) if final else _plain(rest)
        return ParseResult(
            content=content.strip(), calls=calls, partial=partial, partial_offset=partial_offset
        )

    def call_started(self, text: str, since: int = 0) -> int | None:
        """Where a call starts in either form (module docstring); only a marker ending after
        `since` counts (both forms' markers end with `to=functions.`: a window of the longer
        marker's length would find a call again for every token after it)."""
        i = text.find(_HEADER, max(0, since - len(_HEADER) + 1))
        if i < 0:
            return None
        channel = text.rfind(self.start[: -len(_HEADER)], 0, i)  # "<|channel|>commentary "
        if channel >= 0 and not text[channel + len(self.start) - len(_HEADER) : i].strip():
            return channel
        return i

    def held_back(self, text: str) -> int:
        """The longest suffix of `text` that could begin a call in either form."""
        return max(marker_prefix_at_end(text, self.start), marker_prefix_at_end(text, _HEADER))

    def named_prefix(self, name: str) -> str:
        return f"{self.start}{name} <|constrain|>json<|message|>"

    def call_suffix(self) -> str:
        return self.end
