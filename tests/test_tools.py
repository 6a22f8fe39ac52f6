"""Tools: schema from the signature, validation errors, sync/async calls, timeouts."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

from freetoken_agents import ToolArgumentsInvalid, ToolTimeout, tool


@tool
def search(query: str, limit: int = 3, mode: Literal["fast", "deep"] = "fast") -> list[str]:
    """Search the index."""
    return [query] * limit


def test_schema_from_signature() -> None:
    s = search.json_schema()
    assert s["type"] == "function" and s["function"]["name"] == "search"
    assert s["function"]["description"] == "Search the index."
    params = s["function"]["parameters"]
    assert params["required"] == ["query"] and params["additionalProperties"] is False
    assert params["properties"]["limit"] == {"default": 3, "type": "integer"}
    assert params["properties"]["mode"]["enum"] == ["fast", "deep"]


def test_validation_errors_name_the_field() -> None:
    assert search.call(search.validate('{"query": "x", "limit": 2}')) == ["x", "x"]
    with pytest.raises(ToolArgumentsInvalid, match="limit"):
        search.validate({"query": "x", "limit": "many"})
    with pytest.raises(ToolArgumentsInvalid, match="not JSON"):
        search.validate("{oops")
    with pytest.raises(ToolArgumentsInvalid):
        search.validate({"query": "x", "extra": 1})


def test_async_tool_and_timeout() -> None:
    @tool(timeout=0.05, name="nap")
    async def sleeper(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "rested"

    assert sleeper.is_async and sleeper.name == "nap"
    assert sleeper.call(sleeper.validate({"seconds": 0})) == "rested"
    with pytest.raises(ToolTimeout):
        sleeper.call(sleeper.validate({"seconds": 1}))


def test_sync_tool_timeout_runs_in_a_thread() -> None:
    import time

    @tool(timeout=0.05)
    def block(seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    with pytest.raises(ToolTimeout):
        block.call(block.validate({"seconds": 0.5}))
