"""A Responses request as the chat-completions request it means, so it runs the same checks,
grammar compile, queue, prompt preparation and chat turn as POST /v1/chat/completions.

`instructions` becomes a leading system message; `input` items become chat messages (a
`function_call` joins the assistant message before it, or opens one; a `function_call_output` is
a tool message; `reasoning` items are left out); function tools, tool_choice, text.format and
max_output_tokens map onto their chat twins. `ParamNames.rename` turns an error the chat path
raises (which names `messages[3].tool_calls[0].function.arguments`, `max_tokens`, ...) into one
naming the Responses request's own field (`input[5].arguments`, `max_output_tokens`, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from .errors import OpenAIError, bad_request
from .responses_schemas import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
    TextPart,
)
from .schemas import ChatCompletionRequest


def refuse_unsupported(body: ResponsesRequest) -> None:
    """A 400 naming each field whose effect the server cannot give."""
    if body.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: this server stores no responses (store is false); "
            "send the whole conversation in `input`",
            param="previous_response_id",
        )
    if body.conversation is not None:
        raise bad_request(
            "conversation is not supported: this server stores no conversations", param="conversation"
        )
    if body.background:
        raise bad_request("background responses are not supported: nothing is stored", param="background")
    if body.prompt is not None:
        raise bad_request("prompt (a stored prompt template) is not supported", param="prompt")
    if body.top_logprobs:
        raise bad_request("top_logprobs is not supported", param="top_logprobs")
    if body.max_tool_calls is not None:
        raise bad_request("max_tool_calls is not supported", param="max_tool_calls")


@dataclass
class ParamNames:
    """Where each chat message and tool call came from: `messages[m]` is `input[items[m]]` (None:
    the instructions), `messages[m].tool_calls[j]` is `input[calls[m, j]]`."""

    items: list[int | None] = field(default_factory=list)
    calls: dict[tuple[int, int], int] = field(default_factory=dict)

    def param(self, param: str | None) -> str | None:
        if param is None:
            return None
        if m := re.fullmatch(r"messages\[(\d+)\]\.tool_calls\[(\d+)\]\.function\.arguments", param):
            k = self.calls.get((int(m[1]), int(m[2])))
            return f"input[{k}].arguments" if k is not None else "input"
        if m := re.fullmatch(r"messages\[(\d+)\](.*)", param):
            index = int(m[1])
            k = self.items[index] if index < len(self.items) else None
            return "instructions" if k is None else f"input[{k}]"
        if param == "messages":
            return "input"
        if param == "max_tokens":
            return "max_output_tokens"
        if param.startswith("response_format"):
            return "text.format" + (".schema" if param.endswith(".schema") else "")
        return param  # tools.NAME, tool_choice, model: the same names

    def rename(self, error: OpenAIError) -> OpenAIError:
        param, message = self.param(error.param), error.message
        if error.param and param:
            message = message.replace(error.param, param)
        for chat, responses in _WORDS:
            message = message.replace(chat, responses)
        return OpenAIError(
            error.status,
            message,
            type=error.type,
            param=param,
            code=error.code,
            headers=error.headers,
        )


_WORDS = (
    ("max_tokens", "max_output_tokens"),
    ("your messages", "your input"),
    ("in the messages", "in the input"),
    ("length of the messages", "length of the input"),
    ("response_format", "text.format"),
)


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def chat_request(body: ResponsesRequest) -> tuple[ChatCompletionRequest, ParamNames]:
    """The chat request `body` means, and how to name its fields back; OpenAIError (400) for an
    input with no message."""
    names = ParamNames()
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
        names.items.append(None)
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    last_call = False  # the last message is an assistant message that function calls may join
    for k, item in enumerate(items):
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
            last_call = item.role == "assistant"
        elif isinstance(item, FunctionCallItem):
            if not last_call:
                messages.append({"role": "assistant", "content": None})
            calls = messages[-1].setdefault("tool_calls", [])
            names.calls[len(messages) - 1, len(calls)] = k
            calls.append(
                {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
            )
            last_call = True
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
            last_call = False
        else:  # reasoning: not part of the prompt
            continue
        if len(names.items) < len(messages):
            names.items.append(k)
    if not any(m["role"] != "system" for m in messages):
        raise bad_request("input: there is no message to answer", param="input")
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user,
    }
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
            for tool in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        chat["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.name, "schema": fmt.json_schema or {}, "strict": fmt.strict},
        }
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    try:
        return ChatCompletionRequest.model_validate(chat), names
    except ValidationError as e:  # past what the Responses schema checks: too many messages
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"input: {where}: {first['msg']}", param="input") from None
