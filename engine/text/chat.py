"""Chat templates: the checkpoint's own, or the engine's documented default.

DEFAULT_CHAT_TEMPLATE is ChatML with Hermes-style tool calls, the format the Qwen family uses:

    <|im_start|>system
    {system prompt}

    # Tools
    ... <tools>{one JSON schema per line}</tools> ...<|im_end|>
    <|im_start|>user
    {text}<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": ..., "arguments": {...}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    {tool result}
    </tool_response><|im_end|>
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..template.budget import TemplateBudget
from ..template.inputs import template_source, template_variables
from ..template.sandbox import render_template
from .tokenize import added_pattern, defuse

logger = logging.getLogger(__name__)

TRUSTED_ROLES = frozenset({"system", "assistant"})
"""Roles whose content keeps today's tokenization (a special-token string in it becomes the control
token): the developer's system prompt and the model's own past turns. Every other role (user, tool,
documents, ...) is untrusted: its text never yields a control token (`render_chat_spans`)."""

DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
    "{% if message.tool_calls %}"
    "{% for call in message.tool_calls %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "{% if message.content or not loop.first %}\n{% endif %}"
    '<tool_call>\n{"name": "{{ fn.name }}", "arguments": '
    "{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    *,
    add_generation_prompt: bool = True,
    budget: TemplateBudget | None = None,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """`messages` as text in the tokenizer's chat template (DEFAULT_CHAT_TEMPLATE when it has none).

    The one rendering path: the engine's prompts and the embedded model's training corpus both
    go through it, so the model is trained on exactly the text it is later prompted with.
    The template is untrusted code: it renders in the engine's budgeted sandbox
    (`template.sandbox`: transformers' environment, so the text is the same as
    `apply_chat_template(..., tokenize=False)`), within `budget` (default `TemplateBudget()`:
    TEMPLATE_RENDER_SECONDS, TEMPLATE_MAX_CHARS...). `variables`: more template variables
    (chat-template kwargs such as `enable_thinking`; `template.inputs.template_variables`).
    ChatTemplateError, one line, when the template refuses the messages, breaks the budget or
    fails."""
    source = template_source(tokenizer, tools, DEFAULT_CHAT_TEMPLATE)
    values = template_variables(tokenizer, messages, tools, add_generation_prompt, variables)
    return render_template(source, values, budget)


def render_chat_spans(
    tokenizer: Any,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    *,
    add_generation_prompt: bool = True,
    variables: Mapping[str, Any] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """`render_chat`'s text and the [start, end) spans of it that came from untrusted contents.

    Each untrusted text (a string content, or the text of each part of a list content: OpenAI's
    `[{"type": "text", "text": ...}]`) is bracketed by a pair of unique whitespace-free sentinels
    and the template rendered once so and once plainly. Between a pair lies the text as the
    template wrote it (verbatim, or transformed character-wise: gpt-oss's template writes tool
    results through `tojson`); that is the span, and the sentinels are dropped. When the result is
    not the plain rendering (the template dropped or reworked a content: `trim`, slicing, a test on
    its text), the contents are located verbatim in the plain rendering, and if that fails too (or
    there are more than MAX_LOCATED distinct ones to look for) their special-token strings are
    escaped (a zero-width space after the first character) so that they cannot become control
    tokens: fail closed. Linear in the rendered text (the sentinels are paired in one pass)."""
    marker = f"FTUNTRUSTED{secrets.token_hex(8)}"
    contents: list[str] = []
    marked = [_mark(message, marker, contents) for message in messages]
    gen = add_generation_prompt
    plain = render_chat(tokenizer, messages, tools, add_generation_prompt=gen, variables=variables)
    if not contents:
        return plain, []
    text = render_chat(tokenizer, marked, tools, add_generation_prompt=gen, variables=variables)
    found = _unmark(text, marker)
    if found is not None and found[0] == plain:
        return found
    return _fallback(tokenizer, messages, plain, tools, gen, contents, variables)


MAX_LOCATED = 64
"""Most distinct untrusted contents with special-token text `_fallback` searches the rendering for
(each search reads the whole text); past it they are escaped instead."""


def _untrusted(message: Any) -> bool:
    return isinstance(message, dict) and message.get("role") not in TRUSTED_ROLES


def _map_texts(message: dict, change: Callable[[str], str]) -> dict:
    """`message` with `change` applied to its untrusted texts: a non-empty string content, the
    non-empty "text" of each part of a list content."""
    content = message.get("content")
    if isinstance(content, str) and content:
        return {**message, "content": change(content)}
    if isinstance(content, list):
        parts = [
            {**part, "text": change(part["text"])}
            if isinstance(part, dict) and isinstance(part.get("text"), str) and part["text"]
            else part
            for part in content
        ]
        return {**message, "content": parts}
    return message


def _mark(message: Any, marker: str, contents: list[str]) -> Any:
    """An untrusted `message` with each of its texts bracketed by the k-th pair of sentinels (k:
    the text's index in `contents`, where it is appended); a trusted one as it is."""
    if not _untrusted(message):
        return message

    def bracket(text: str) -> str:
        contents.append(text)
        k = len(contents) - 1
        return f"{marker}A{k}Z{text}{marker}B{k}Z"

    return _map_texts(message, bracket)


def _unmark(text: str, marker: str) -> tuple[str, list[tuple[int, int]]] | None:
    """`text` without its sentinels and the spans they bracketed; None unless they come in pairs,
    each opening followed by its own closing (the template dropped or cut one)."""
    tags = list(re.finditer(rf"{marker}([AB])(\d+)Z", text))
    if len(tags) % 2:
        return None
    out, spans, last, length = [], [], 0, 0
    for opening, closing in zip(tags[::2], tags[1::2], strict=True):
        if (opening[1], closing[1]) != ("A", "B") or opening[2] != closing[2]:
            return None
        out.append(text[last : opening.start()])
        length += opening.start() - last
        inner = text[opening.end() : closing.start()]
        out.append(inner)
        spans.append((length, length + len(inner)))
        length += len(inner)
        last = closing.end()
    out.append(text[last:])
    return "".join(out), spans


def _fallback(
    tokenizer: Any,
    messages: Sequence[dict],
    text: str,
    tools: Sequence[dict] | None,
    gen: bool,
    contents: list[str],
    variables: Mapping[str, Any] | None,
) -> tuple[str, list[tuple[int, int]]]:
    """Spans of the plain rendering `text` by verbatim search of the untrusted contents, for a
    template that reworked them (the bracketed rendering was not `text`)."""
    pattern = added_pattern(tokenizer)
    if pattern is None:
        return text, []
    risky = list(dict.fromkeys(c for c in contents if pattern.search(c)))
    if len(risky) <= MAX_LOCATED and all(c in text for c in risky):
        spans = []
        for content in risky:
            start = text.find(content)
            while start != -1:
                spans.append((start, start + len(content)))
                start = text.find(content, start + len(content))
        return text, spans
    logger.warning("chat template transformed untrusted content: escaping its special-token text")

    def escape(content: str) -> str:
        return "\u200b".join(defuse(pattern, content))

    escaped = [_map_texts(m, escape) if _untrusted(m) else m for m in messages]
    return render_chat(tokenizer, escaped, tools, add_generation_prompt=gen, variables=variables), []
