"""LangChain messages -> the chat-template dicts `Engine.apply_chat_template` renders.

- Text comes from `message.text` (list content: the text blocks joined). The engine reads text
  only: an image, audio, video or file block raises `UnsupportedContentError` (dropping it and
  answering anyway would answer a question the user did not ask); other blocks (reasoning, a
  provider's tool_use) are left out.
- `AIMessage.tool_calls` become OpenAI-style `tool_calls` entries (arguments as a dict), the shape
  Hugging Face chat templates read.
- `ToolMessage` becomes role "tool"; `status="error"` is made visible to the model by an
  "Error: " prefix (unless the text already starts with one).
- Leading system messages are merged into one (many templates accept a system message only
  first); other repeated roles are kept as they are. `name` is passed through as a key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)


class UnsupportedContentError(ValueError):
    """A message holds a content block the model cannot read (an image, audio, video or file)."""


_UNSUPPORTED_BLOCKS = {
    "image": "images",
    "image_url": "images",
    "audio": "audio inputs",
    "input_audio": "audio inputs",
    "video": "videos",
    "file": "files",
    "text-plain": "files",
    "document": "documents",
}


def _refuse_media(message: BaseMessage, index: int | None) -> None:
    if isinstance(message.content, str):
        return
    for block in message.content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in _UNSUPPORTED_BLOCKS:
            where = f"message {index} ({message.type})" if index is not None else f"a {message.type} message"
            raise UnsupportedContentError(
                f"{where} holds a {kind!r} block: {_UNSUPPORTED_BLOCKS[kind]} are not supported "
                "(ChatFreeToken reads text only)"
            )


def _role(message: BaseMessage) -> str:
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, (ToolMessage, FunctionMessage)):
        return "tool"
    if isinstance(message, ChatMessage):
        return {"human": "user", "ai": "assistant"}.get(message.role, message.role)
    raise ValueError(f"cannot render a {type(message).__name__} with a chat template")


def to_chat_dict(message: BaseMessage, index: int | None = None) -> dict[str, Any]:
    """One message as a chat-template dict (`index`: its place in the conversation, for errors)."""
    _refuse_media(message, index)
    role = _role(message)
    out: dict[str, Any] = {"role": role, "content": message.text}
    if message.name:
        out["name"] = message.name
    if isinstance(message, AIMessage) and message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": call["name"], "arguments": call.get("args") or {}},
            }
            for call in message.tool_calls
        ]
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
        if message.status == "error" and not out["content"].lstrip().lower().startswith("error"):
            out["content"] = f"Error: {out['content']}"
    return out


def to_chat_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """A conversation as chat-template dicts, leading system messages merged."""
    dicts = [to_chat_dict(m, i) for i, m in enumerate(messages)]
    while len(dicts) > 1 and dicts[0]["role"] == "system" and dicts[1]["role"] == "system":
        second = dicts.pop(1)
        dicts[0] = {**dicts[0], "content": f"{dicts[0]['content']}\n\n{second['content']}"}
    return dicts
