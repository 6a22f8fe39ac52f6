"""LangChain messages -> the chat-template dicts `Engine.apply_chat_template` renders.

- Text comes from `message.text` (list content: the text blocks joined; images and other blocks
  are dropped, the engine takes text only).
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


def to_chat_dict(message: BaseMessage) -> dict[str, Any]:
    """One message as a chat-template dict."""
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
    dicts = [to_chat_dict(m) for m in messages]
    while len(dicts) > 1 and dicts[0]["role"] == "system" and dicts[1]["role"] == "system":
        second = dicts.pop(1)
        dicts[0] = {**dicts[0], "content": f"{dicts[0]['content']}\n\n{second['content']}"}
    return dicts
