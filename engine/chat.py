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
from collections.abc import Sequence
from typing import Any

import jinja2

from .errors import ChatTemplateError
from .tokenize import added_tokens

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
) -> str:
    """`messages` as text in the tokenizer's chat template (DEFAULT_CHAT_TEMPLATE when it has none).

    The one rendering path: the engine's prompts and the embedded model's training corpus both
    go through it, so the model is trained on exactly the text it is later prompted with.
    ChatTemplateError when the template refuses the messages."""
    try:
        return tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            chat_template=getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE,
            tokenize=False,
        )
    except jinja2.TemplateError as e:
        line = " ".join(str(e).split()) or type(e).__name__
        raise ChatTemplateError(f"the chat template refused the messages: {line}") from None


def render_chat_spans(
    tokenizer: Any,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> tuple[str, list[tuple[int, int]]]:
    """`render_chat`'s text and the [start, end) spans of it that came from untrusted contents.

    Each untrusted string content is bracketed by a pair of unique whitespace-free sentinels and the
    template rendered once so and once plainly. Between a pair lies the content as the template
    wrote it (verbatim, or transformed character-wise: gpt-oss's template writes tool results
    through `tojson`); that is the span, and the sentinels are dropped. When the result is not the
    plain rendering (the template dropped or reworked a content: `trim`, slicing, a test on its
    text), the contents are located verbatim in the plain rendering, and if that fails too their
    special-token strings are escaped (a zero-width space after the first character) so that
    they cannot become control tokens: fail closed."""
    nonce = secrets.token_hex(8)
    marker = f"FTUNTRUSTED{nonce}"
    marked, contents = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if message.get("role") in TRUSTED_ROLES or not isinstance(content, str) or not content:
            marked.append(message)
            continue
        contents.append(content)
        marked.append({**message, "content": f"{marker}A{i}Z{content}{marker}B{i}Z"})
    plain = render_chat(tokenizer, messages, tools, add_generation_prompt=add_generation_prompt)
    if not contents:
        return plain, []
    text = render_chat(tokenizer, marked, tools, add_generation_prompt=add_generation_prompt)
    pattern = re.compile(rf"{marker}A(\d+)Z(.*?){marker}B\1Z", re.DOTALL)
    out, spans, last, length = [], [], 0, 0
    for match in pattern.finditer(text):
        out.append(text[last : match.start()])
        length += match.start() - last
        inner = match.group(2)
        out.append(inner)
        spans.append((length, length + len(inner)))
        length += len(inner)
        last = match.end()
    out.append(text[last:])
    rendered = "".join(out)
    if rendered == plain:
        return rendered, spans
    return _fallback(tokenizer, messages, plain, tools, add_generation_prompt, contents)


def _fallback(
    tokenizer: Any,
    messages: Sequence[dict],
    text: str,
    tools: Sequence[dict] | None,
    gen: bool,
    contents: list[str],
) -> tuple[str, list[tuple[int, int]]]:
    """Spans of the plain rendering `text` by verbatim search of the untrusted contents, for a
    template that reworked them (the bracketed rendering was not `text`)."""
    specials = added_tokens(tokenizer)
    risky = [c for c in contents if any(t in c for t in specials)]
    if any(c not in text for c in risky):
        logger.warning("chat template transformed untrusted content: escaping its special-token text")
        escaped = []
        for message in messages:
            content = message.get("content")
            if message.get("role") not in TRUSTED_ROLES and isinstance(content, str):
                for token in specials:
                    content = content.replace(token, token[:1] + "\u200b" + token[1:])
                message = {**message, "content": content}
            escaped.append(message)
        return render_chat(tokenizer, escaped, tools, add_generation_prompt=gen), []
    spans = []
    for content in risky:
        start = text.find(content)
        while start != -1:
            spans.append((start, start + len(content)))
            start = text.find(content, start + len(content))
    return text, spans
