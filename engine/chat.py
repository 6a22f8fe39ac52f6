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

from collections.abc import Sequence
from typing import Any

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
    go through it, so the model is trained on exactly the text it is later prompted with."""
    return tokenizer.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        chat_template=getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE,
        tokenize=False,
    )
