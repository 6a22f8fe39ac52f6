"""A chat-completions request's messages as the chat template takes them.

Text parts joined into one string, assistant tool calls with their arguments parsed into dicts (a
JSON object, bounded in nesting and number length, else a 400 naming the field), tool results with
the name of the call they answer.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import bad_request
from .schemas import ChatCompletionRequest, Content


def content_text(content: Content) -> str:
    """A message's content as one string (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them: assistant tool calls with their
    arguments parsed into dicts (so they render exactly as the model writes them), tool results
    with the name of the call they answer."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, message in enumerate(request.messages):
        if message.role in ("system", "developer"):
            out.append({"role": "system", "content": content_text(message.content)})
        elif message.role == "user":
            out.append({"role": "user", "content": content_text(message.content)})
        elif message.role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": content_text(message.content)}
            calls = []
            for j, call in enumerate(message.tool_calls or []):
                arguments = _arguments(
                    call.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments"
                )
                calls.append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": arguments},
                    }
                )
                if call.id:
                    names[call.id] = call.function.name
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
        else:
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": message.tool_call_id,
                    "name": names.get(message.tool_call_id, ""),
                    "content": content_text(message.content),
                }
            )
    return out


MAX_ARGUMENT_DEPTH = 64  # nesting of a tool call's arguments in the messages (as for schemas)
MAX_NUMBER_CHARS = 100  # characters of one number in them (Python refuses ints past 4,300 digits)


def _arguments(text: str, param: str) -> dict[str, Any]:
    """A past call's arguments: a JSON object, nested at most MAX_ARGUMENT_DEPTH levels, its
    numbers finite and at most MAX_NUMBER_CHARS long; else a 400 naming `param` (a deep nesting
    was a RecursionError, a 5,001-digit integer a ValueError: both a 500)."""
    try:
        value = json.loads(text or "{}", parse_int=_int, parse_float=_float, parse_constant=_not_json)
    except json.JSONDecodeError as e:
        raise bad_request(f"{param}: not valid JSON ({e.msg} at position {e.pos})", param=param) from None
    except RecursionError:
        raise bad_request(f"{param}: nested deeper than {MAX_ARGUMENT_DEPTH} levels", param=param) from None
    except ValueError as e:  # a number `_int` / `_float` / `_not_json` refused
        raise bad_request(f"{param}: {e}", param=param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param}: must be a JSON object, got {type(value).__name__}", param=param)
    if _depth_over(value, MAX_ARGUMENT_DEPTH):
        raise bad_request(f"{param}: nested deeper than {MAX_ARGUMENT_DEPTH} levels", param=param)
    return value


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"a number of {len(text)} characters; at most {MAX_NUMBER_CHARS}")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"a number of {len(text)} characters; at most {MAX_NUMBER_CHARS}")
    value = float(text)
    if not math.isfinite(value):  # 1e999: the template would write Infinity, which is not JSON
        raise ValueError(f"the number {text} is out of range")
    return value


def _not_json(text: str) -> Any:
    raise ValueError(f"{text} is not a JSON value")


def _depth_over(value: Any, limit: int) -> bool:
    """Whether `value` nests deeper than `limit` levels (iteratively: no recursion to run out)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False
