"""ScriptedModel: the weight-free test model users test their agents with (no engine here)."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

from freetoken_agents import (
    Agent,
    ModelBackend,
    RetryPolicy,
    ToolExecutionError,
    ToolRetryExhausted,
    UnexpectedModelBehavior,
    tool,
)
from freetoken_agents.parsers import parser_for
from freetoken_agents.testing import ScriptedModel, ToolCall

FAST = RetryPolicy(initial_backoff=0.0, max_backoff=0.0)


@tool
def get_weather(city: Literal["Paris", "Tokyo"]) -> dict:
    "Current weather."
    return {"city": city, "temperature": 21}


def test_plays_a_call_then_an_answer() -> None:
    model = ScriptedModel([ToolCall("get_weather", {"city": "Paris"}), "Sunny, 21 degrees."])
    assert isinstance(model, ModelBackend)
    result = Agent(model, [get_weather], system_prompt="Be brief.").run("Weather in Paris?")
    assert result.output == "Sunny, 21 degrees." and model.remaining == 0
    (call,) = result.trace.tool_calls
    assert (call.tool, call.arguments, call.result) == (
        "get_weather",
        {"city": "Paris"},
        get_weather.fn("Paris"),
    )
    assert [a.kind for a in result.trace.anchors] == ["system_prompt", "tool_call", "tool_result"]
    assert [m["role"] for m in result.messages] == ["system", "user", "assistant", "tool", "assistant"]
    # The second turn saw the tool's result, and its context reused the first turn's prefix.
    assert '"temperature": 21' in model.contexts[1] and model.usage().reused > 0


def test_failed_call_rolls_back_and_the_model_sees_the_note() -> None:
    failures = [ValueError("city is closed")]

    @tool
    def book(city: str) -> str:
        "Book a table."
        if failures:
            raise failures.pop()
        return f"booked in {city}"

    model = ScriptedModel(
        [ToolCall("book", {"city": "Atlantis"}), ToolCall("book", {"city": "Paris"}), "Done."]
    )
    result = Agent(model, [book], retry=FAST).run("Book a table")
    (rb,) = result.trace.rollbacks
    anchor = next(a for a in result.trace.anchors if a.kind == "tool_call")
    assert rb.to_position == anchor.position and not rb.rebuilt
    assert result.trace.tokens_saved_by_rollback == anchor.position == model.usage().saved_by_rollback
    retried = model.contexts[1]
    assert "city is closed" in retried[anchor.position :]  # the failure note follows the anchor
    assert "Atlantis" not in retried  # the failed call is gone from the context
    assert retried[: anchor.position] == model.contexts[0][: anchor.position]
    assert result.trace.tool_calls[0].result == "booked in Paris" and result.output.endswith("Done.")


def test_malformed_and_unterminated_calls_are_retried() -> None:
    script = [
        ToolCall("get_weather", raw='{"name": "get_weather", "arguments": {oops}'),
        '<tool_call>\n{"name": "get_weather", "argu',  # unterminated
        ToolCall("get_weather", {"city": "Tokyo"}),
        "ok",
    ]
    result = Agent(ScriptedModel(script), [get_weather], retry=RetryPolicy(model_attempts=3)).run("go")
    assert [r.error_type for r in result.trace.retries] == ["ToolCallMalformed", "ToolCallMalformed"]
    assert result.trace.tool_calls[0].arguments == {"city": "Tokyo"}


def test_exhaustion_and_type_errors() -> None:
    script = [ToolCall("get_weather", {"city": "Rome"})] * 2
    with pytest.raises(ToolRetryExhausted) as info:
        Agent(ScriptedModel(script), [get_weather], retry=RetryPolicy(model_attempts=2)).run("go")
    assert [a.error_type for a in info.value.attempts] == ["ToolArgumentsInvalid"] * 2

    @tool
    def buggy(n: int) -> int:
        "A tool with a bug."
        return n + "1"  # TypeError: a bug, not the model's fault

    with pytest.raises(ToolExecutionError) as err:
        Agent(ScriptedModel([ToolCall("buggy", {"n": 1})]), [buggy], retry=FAST).run("go")
    assert isinstance(err.value.__cause__, TypeError) and err.value.tool == "buggy"


def test_script_mismatch_and_exhaustion_raise() -> None:
    with pytest.raises(UnexpectedModelBehavior, match="forces one"):
        Agent(ScriptedModel(["no call"]), [get_weather], tool_choice="required").run("go")
    with pytest.raises(UnexpectedModelBehavior, match="ran out of turns"):
        Agent(ScriptedModel([ToolCall("get_weather", {"city": "Paris"})]), [get_weather]).run("go")


def test_code_fence_anchor_sits_before_the_fence() -> None:
    text = "Here you go:\n```python\nprint(1)\n```\nand\n```\nx\n```"
    model = ScriptedModel([text], chunk=5)
    result = Agent(model).run("code please")
    fences = [a for a in result.trace.anchors if a.kind == "code_block"]
    assert len(fences) == 2
    start = len(model.contexts[0])
    context = model.text
    assert [context[a.position : a.position + 3] for a in fences] == ["```", "```"]
    assert fences[0].position == start + text.index("```")
    assert result.output == text


def test_callable_turns_stream_events_and_async() -> None:
    def decide(request, context: str):
        return ToolCall("get_weather", {"city": "Tokyo"}) if "Tokyo" in context else "no city"

    model = ScriptedModel([decide, "It is 21."])
    agent = Agent(model, [get_weather], tool_choice=lambda step: "get_weather" if step == 1 else "none")

    async def collect() -> list:
        return [e async for e in agent.astream("Weather in Tokyo?")]

    events = asyncio.run(collect())
    kinds = [e.kind for e in events]
    assert kinds[-1] == "final" and kinds.index("tool_call") < kinds.index("tool_result")
    assert model.requests[0].force == "get_weather" and model.requests[1].tools == []
    assert "".join(e.data for e in events if e.kind == "text" and e.step == 2) == "It is 21."


@pytest.mark.parametrize("family", ["hermes", "mistral", "deepseek", "harmony"])
def test_calls_use_the_family_format(family: str) -> None:
    model = ScriptedModel([ToolCall("get_weather", {"city": "Paris"}), "ok"], family=family)
    result = Agent(model, [get_weather]).run("go")
    assert result.trace.tool_calls[0].arguments == {"city": "Paris"}
    assert parser_for(family).start in model.contexts[1]


def test_parser_rejects_unknown_family() -> None:
    with pytest.raises(ValueError, match="unknown tool-call family"):
        ScriptedModel([], family="nope")


def test_closing_a_stream_early_cancels_the_run() -> None:
    model = ScriptedModel([ToolCall("get_weather", {"city": "Paris"}), "unused", "Second run."])
    agent = Agent(model, [get_weather])
    for event in agent.stream("Weather?"):
        if event.kind == "tool_call":
            break  # the consumer walks away mid-run
    assert model.remaining == 2  # the run stopped: no further turn was generated
    model.turns.pop(1)
    assert agent.run("Again").output == "Second run."


def test_common_prefix_length() -> None:
    from freetoken_agents.model import common_prefix_length

    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2], [1, 2]) == 2
