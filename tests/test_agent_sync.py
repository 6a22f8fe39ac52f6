"""The synchronous entry points (`run`, `stream`) work inside a running event loop (Jupyter, an
async web handler): the run gets its own loop on a worker thread."""

from __future__ import annotations

import asyncio

from freetoken_agents import Agent, tool
from freetoken_agents.testing import ScriptedModel, ToolCall


@tool
async def add(a: int, b: int) -> int:
    "Add two integers."
    await asyncio.sleep(0)
    return a + b


def script() -> ScriptedModel:
    return ScriptedModel([ToolCall("add", {"a": 2, "b": 3}), "It is 5."])


def test_run_inside_a_running_event_loop() -> None:
    async def handler() -> str:
        return Agent(script(), [add]).run("2 + 3?").output

    assert asyncio.run(handler()) == "It is 5."


def test_stream_inside_a_running_event_loop() -> None:
    async def handler() -> list[str]:
        return [e.kind for e in Agent(script(), [add]).stream("2 + 3?")]

    kinds = asyncio.run(handler())
    assert kinds[-1] == "final" and "tool_result" in kinds


def test_run_and_stream_without_a_loop() -> None:
    assert Agent(script(), [add]).run("2 + 3?").trace.tool_calls[0].result == 5
    assert [e.kind for e in Agent(script(), [add]).stream("2 + 3?")][-1] == "final"


def test_closing_a_stream_early_inside_a_loop() -> None:
    async def handler() -> str:
        events = Agent(script(), [add]).stream("2 + 3?")
        first = next(events)
        events.close()
        return first.kind

    assert asyncio.run(handler()) in {"anchor", "text"}
