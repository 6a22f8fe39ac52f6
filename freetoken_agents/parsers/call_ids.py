"""Tool-call ids every chat template accepts: nine letters and digits.

The ids are ours to choose (OpenAI clients treat them as opaque strings), but templates are strict:
Mistral's (Nemo, Small 3.x) raise "Tool call IDs should be alphanumeric strings with length 9!" on
the next turn for any other id. So every id we make (the Agent, ChatFreeToken, the server) has that
form, and an id a client sends back in another form (OpenAI's `call_...`, another server's) is
mapped, when a prompt is rendered, to a nine-character id derived from it: the same id always maps
to the same one, so an assistant call and its tool result still match and prompts re-sent by a
client stay the same prefix.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import string
from collections.abc import Sequence
from typing import Any

ALPHABET = string.ascii_letters + string.digits
LENGTH = 9
_VALID = re.compile(rf"[A-Za-z0-9]{{{LENGTH}}}")

__all__ = ["new_call_id", "step_call_id", "template_call_id", "with_template_call_ids"]


def new_call_id() -> str:
    """A random id (62^9 values: collisions within one conversation are negligible)."""
    return "".join(secrets.choice(ALPHABET) for _ in range(LENGTH))


def step_call_id(step: int, index: int) -> str:
    """A deterministic id for the `index`th call of agent step `step`: 'c' + 4 + 4 base-36 digits."""
    return "c" + _base36(step % 36**4, 4) + _base36(index % 36**4, 4)


def template_call_id(call_id: str) -> str:
    """`call_id` itself when it already has the accepted form, else a nine-character id derived
    from it (blake2b, in base 62)."""
    if _VALID.fullmatch(call_id):
        return call_id
    n = int.from_bytes(hashlib.blake2b(call_id.encode(), digest_size=8).digest(), "big")
    out = []
    for _ in range(LENGTH):
        n, r = divmod(n, len(ALPHABET))
        out.append(ALPHABET[r])
    return "".join(out)


def with_template_call_ids(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with every assistant tool call's `id` and every tool message's `tool_call_id`
    in the accepted form (`template_call_id`); other fields untouched, inputs not modified."""
    out: list[dict[str, Any]] = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list) and any(
            isinstance(c, dict) and isinstance(c.get("id"), str) for c in calls
        ):
            message = {**message, "tool_calls": [_with_id(c) for c in calls]}
        call_id = message.get("tool_call_id") if isinstance(message, dict) else None
        if isinstance(call_id, str):
            message = {**message, "tool_call_id": template_call_id(call_id)}
        out.append(message)
    return out


def _with_id(call: Any) -> Any:
    if isinstance(call, dict) and isinstance(call.get("id"), str):
        return {**call, "id": template_call_id(call["id"])}
    return call


def _base36(n: int, width: int) -> str:
    digits = string.digits + string.ascii_lowercase
    out = ""
    for _ in range(width):
        n, r = divmod(n, 36)
        out = digits[r] + out
    return out
