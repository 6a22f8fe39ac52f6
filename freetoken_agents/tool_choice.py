"""Tool choice: which call, if any, a turn must make (`tool_choice` of an Agent, ChatFreeToken
and the OpenAI-compatible server), and what it resolves to for the constrained decoder."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

ToolChoice = Literal["auto", "none", "required"] | str
"""'auto': the model decides (calls it starts are constrained); 'none': no tools; 'required':
some tool must be called; any other string: that tool must be called."""


class NamedToolChoice(BaseModel):
    name: str


def resolve_tool_choice(choice: ToolChoice, tool_names: list[str]) -> str | None:
    """None when no call is forced; '*' for any tool; else the forced tool's name."""
    if choice in ("auto", "none"):
        return None
    if choice == "required":
        return "*"
    if choice not in tool_names:
        raise ValueError(f"tool_choice {choice!r} is not one of the agent's tools {tool_names}")
    return choice
