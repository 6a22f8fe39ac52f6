"""What the model reads of a tool's result: `result_text` (strings as they are, other values as
JSON, cut at a character cap with a note saying so) and the default cap, `default_result_chars`
(a quarter of the context). Apart from `tools` so the trace, which records results as the model
read them, does not import the tools that run them."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

CHARS_PER_TOKEN = 4  # a rough estimate for English text under BPE tokenizers
RESULT_CONTEXT_SHARE = 0.25  # the share of the context one tool result may take, at most
DEFAULT_RESULT_CHARS = 16_000  # the cap when the model does not say how long its context is


def default_result_chars(max_context: int | None) -> int:
    """The default cap on a result's characters: a quarter of the context at ~4 characters per
    token (`DEFAULT_RESULT_CHARS` when the context length is unknown), at least 256."""
    if not max_context:
        return DEFAULT_RESULT_CHARS
    return max(256, int(max_context * RESULT_CONTEXT_SHARE * CHARS_PER_TOKEN))


def result_text(result: Any, max_chars: int | None = None) -> str:
    """`result` as the model reads it: a string as is, a pydantic model as its JSON, anything else
    as `json.dumps(result, ensure_ascii=False, default=str)` (`str(result)` if that fails); cut at
    `max_chars` characters with a note saying so. A string is sliced and a structure encoded
    lazily up to the cap, so a huge result costs time and memory in proportion to the cap."""
    if isinstance(result, str):
        text, total = result, len(result)
    else:
        total = None
        if isinstance(result, BaseModel):
            text = result.model_dump_json()  # (pydantic has no lazy encoder)
        else:
            try:
                text = _json_head(result, max_chars)
            except (TypeError, ValueError):
                text = str(result)
    if max_chars is None or len(text) <= max_chars:
        return text
    size = f"{total:,} characters" if total is not None else f"more than {max_chars:,} characters"
    return f"{text[:max_chars]}\n[truncated: the result had {size}; only the first {max_chars:,} are shown]"


def _json_head(result: Any, limit: int | None) -> str:
    """The JSON text of `result` (as json.dumps writes it), only its first `limit` + 1 characters
    when `limit` is given: the pure-Python encoder yields pieces lazily, and it stops there."""
    if limit is None:
        return json.dumps(result, ensure_ascii=False, default=str)
    head: list[str] = []
    size = 0
    for piece in json.JSONEncoder(ensure_ascii=False, default=str).iterencode(result):
        head.append(piece[: limit + 1 - size])
        size += len(head[-1])
        if size > limit:
            break
    return "".join(head)
