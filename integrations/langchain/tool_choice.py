"""LangChain `tool_choice` values -> the SDK's choices ('auto', 'none', 'required', a tool name)."""

from __future__ import annotations

from typing import Any


def normalize_tool_choice(choice: Any, tool_names: list[str]) -> str:
    """Map every `tool_choice` form LangChain providers accept to 'auto', 'none', 'required' or a name.

    Accepted: None / "auto"; "none"; "any" / "required" / True; a tool name; a dict in OpenAI
    (`{"type": "function", "function": {"name": ...}}`), Anthropic (`{"type": "tool"|"any"|"auto"|
    "none", "name": ...}`) or bare (`{"name": ...}`) form. ValueError for anything else, or for a
    name that is not one of `tool_names`.
    """
    if choice is None or choice is False:
        return "auto"
    if choice is True:
        return "required"
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind in ("any", "required", "auto", "none"):
            return normalize_tool_choice(kind, tool_names)
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        if not name:
            raise ValueError(f"tool_choice dict names no tool: {choice!r}")
        choice = name
    if not isinstance(choice, str):
        raise ValueError(f"unsupported tool_choice {choice!r}")
    if choice in ("auto", "none"):
        return choice
    if choice in ("any", "required"):
        return "required"
    if choice not in tool_names:
        raise ValueError(f"tool_choice {choice!r} is not one of the bound tools {tool_names}")
    return choice
