"""A model-scope retry on the embedded model: after the rollback and the failure note, the model's
second call parses and runs (with a note ending in a newline it wrote the call's JSON without its
`<tool_call>` marker, and the raw call became the final answer)."""

from __future__ import annotations

import pytest

from freetoken_agents import Agent, FreeTokenModel, default_model, tool
from freetoken_agents.retry import DEFAULT_NOTE

pytestmark = pytest.mark.usefixtures("one_thread")


def test_default_note_ends_without_newline() -> None:
    assert not DEFAULT_NOTE.endswith("\n")


def test_rejected_call_is_called_again_after_rollback() -> None:
    failures = iter([ValueError("the weather service rejected the request")])
    calls: list[str] = []

    @tool
    def get_weather(city: str) -> dict:
        """Current weather for a city."""
        calls.append(city)
        error = next(failures, None)
        if error is not None:
            raise error
        return {"city": city, "condition": "sunny", "temperature_c": 21}

    agent = Agent(FreeTokenModel.from_pretrained(default_model()), [get_weather], max_steps=4)
    result = agent.run("What is the weather in Osaka?")
    assert calls == ["Osaka", "Osaka"]
    assert len(result.trace.rollbacks) == 1 and len(result.trace.tool_calls) == 1
    assert "<tool_call>" not in result.output and '"name"' not in result.output
