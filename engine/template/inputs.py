"""What a chat template sees, prepared as transformers' `apply_chat_template` prepares it
(transformers 5: `tokenization_utils_base.apply_chat_template` and
`utils/chat_template_utils.render_jinja_template`), so that the engine's own sandboxed render
(`sandbox`) writes the same text:

- the template: the tokenizer's, or from its dict of named templates ``tool_use`` when tools are
  given and ``default`` otherwise;
- messages: objects (dataclasses, pydantic models) as dicts, top-level keys whose value is None
  dropped, everything rebuilt from plain JSON types (anything else becomes ``"<TypeName>"``), and
  a message's reasoning copied under ``thinking`` and ``reasoning_content``;
- tools: JSON schemas (functions converted by transformers' `get_json_schema`), rebuilt the same way;
- variables: ``messages``, ``tools``, ``documents`` (None), ``add_generation_prompt`` and the
  tokenizer's named special tokens (``bos_token``, ``eos_token``...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ChatTemplateError

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # the first is what templates read


def template_source(tokenizer: Any, tools: Sequence[Any] | None, default: str) -> str:
    """The template text `tokenizer` renders with (`default` when it has none)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):
        if tools and "tool_use" in template:
            template = template["tool_use"]
        elif "default" in template:
            template = template["default"]
        else:
            names = ", ".join(sorted(map(str, template)))
            raise ChatTemplateError(
                f"the tokenizer has several chat templates ({names}) and none is 'default'"
            )
    if template is not None and not isinstance(template, str):
        raise ChatTemplateError(f"the tokenizer's chat template is a {type(template).__name__}, not text")
    return template or default


def template_variables(
    tokenizer: Any,
    messages: Sequence[Any],
    tools: Sequence[Any] | None,
    add_generation_prompt: bool,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The variables the template renders with. `extra`: more of them (vLLM's and transformers'
    chat-template kwargs, such as Qwen3's `enable_thinking`); as in transformers they override the
    tokenizer's special tokens but not what the render itself sets (messages, tools, documents,
    add_generation_prompt)."""
    if not messages:
        raise ChatTemplateError("there are no messages to render")
    chat = []
    for message in messages:
        message = _as_dicts(message)
        if not isinstance(message, dict):
            raise ChatTemplateError(f"a chat message must be a dict, not {type(message).__name__}")
        chat.append(_with_reasoning(_plain({k: v for k, v in message.items() if v is not None})))
    specials = getattr(tokenizer, "special_tokens_map", None) or {}
    return {
        **_plain(dict(specials)),
        **_plain(dict(extra or {})),
        "messages": chat,
        "tools": _plain([_schema(tool) for tool in tools]) if tools else None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
    }


def _schema(tool: Any) -> dict:
    if isinstance(tool, dict):
        return tool
    if callable(tool):
        from transformers.utils import get_json_schema  # only for tools given as functions

        try:
            return get_json_schema(tool)
        except Exception as e:  # no docstring, a type hint with no JSON form...
            raise ChatTemplateError(
                f"tool {getattr(tool, '__name__', tool)!r} has no JSON schema: {e}"
            ) from None
    raise ChatTemplateError(f"a tool must be a JSON schema or a function, not {type(tool).__name__}")


def _as_dicts(value: Any) -> Any:
    """Message objects (and objects inside them: tool calls, content blocks) as dicts."""
    if isinstance(value, Mapping):
        return {key: _as_dicts(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_dicts(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_as_dicts(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


def _plain(value: Any) -> Any:
    """`value` rebuilt from exact JSON types: a template never reaches another class's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if type(value).__module__ == "numpy" and _is_numpy_scalar(value):
        return _plain(value.item())  # np.bool_(False) must stay falsy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning(message: dict) -> dict:
    """A message's reasoning under ``thinking`` (gpt-oss reads it) and ``reasoning_content``."""
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _is_numpy_scalar(value: Any) -> bool:
    import numpy as np  # only reached for a numpy value

    return isinstance(value, np.generic)
