"""Each failure class on the REAL engine (tiny random model; tool_choice forces schema-valid calls)."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from pydantic import BaseModel, field_validator
from tiny_models import build_tiny_model

from freetoken_agents import (
    Agent,
    FreeTokenModel,
    RetryableToolError,
    RetryPolicy,
    TokenLimitTooSmall,
    Tool,
    ToolExecutionError,
    ToolRetryExhausted,
    Trace,
    tool,
)
from freetoken_agents.engine import Engine

FAST = RetryPolicy(initial_backoff=0.0, max_backoff=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> FreeTokenModel:
    path = build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("agent_fail"), max_position_embeddings=4096)
    return FreeTokenModel(Engine.from_pretrained(path))


def make_agent(model: FreeTokenModel, t: Tool, retry: RetryPolicy = FAST, **kw) -> Agent:
    return Agent(model, [t], tool_choice=t.name, retry=retry, max_new_tokens=2, max_steps=2, **kw)


def flaky(errors: list[BaseException]):
    """A tool raising `errors` in turn, then returning 'ok'; `.calls` counts its runs."""

    def ping(target: Literal["db", "api"]) -> str:
        "Ping a service."
        ping.calls += 1
        if errors:
            raise errors.pop(0)
        return "ok"

    ping.calls = 0
    return ping


def test_transient_errors_retry_the_tool_without_touching_the_model(model: FreeTokenModel) -> None:
    fn = flaky([ConnectionError("reset"), RetryableToolError("busy")])
    result = make_agent(model, tool(fn)).run("ping the db")
    assert fn.calls == 3 and result.trace.rollbacks == []
    assert [(r.scope, r.error_type) for r in result.trace.retries] == [
        ("tool", "ConnectionError"),
        ("tool", "RetryableToolError"),
    ]
    assert [a.kind for a in result.trace.anchors].count("tool_call") == 1  # generated once


def test_transient_exhaustion_raises_with_attempts(model: FreeTokenModel) -> None:
    fn = flaky([ConnectionError(str(i)) for i in range(10)])
    with pytest.raises(ToolRetryExhausted) as info:
        make_agent(model, tool(fn), RetryPolicy(tool_attempts=3, initial_backoff=0.0)).run("ping")
    assert fn.calls == 3 and len(info.value.attempts) == 3
    assert all(a.scope == "tool" for a in info.value.attempts)


def test_model_error_exhaustion_rolls_back_each_time(model: FreeTokenModel) -> None:
    fn = flaky([ValueError(f"bad {i}") for i in range(10)])
    agent = make_agent(model, tool(fn), RetryPolicy(model_attempts=3))
    with pytest.raises(ToolRetryExhausted) as info:
        agent.run("ping")
    assert fn.calls == 3
    assert [a.error_type for a in info.value.attempts] == ["ModelRetry"] * 3


def test_invalid_arguments_go_back_to_the_model(model: FreeTokenModel) -> None:
    class Args(BaseModel):
        target: Literal["db", "api"]

        @field_validator("target")
        @classmethod
        def once(cls, v: str) -> str:  # stricter than the schema: the first value is refused
            if not seen:
                seen.append(v)
                raise ValueError("that target is down, pick again")
            return v

    seen: list[str] = []
    t = Tool(lambda target: f"pinged {target}", name="ping", description="Ping.", args_model=Args)
    result = make_agent(model, t).run("ping")
    (retry,) = result.trace.retries
    assert retry.error_type == "ToolArgumentsInvalid" and "pick again" in retry.error
    assert len(result.trace.rollbacks) == 1 and result.trace.tool_calls[0].result.startswith("pinged")


def test_rejected_result_rolls_back(model: FreeTokenModel) -> None:
    answers = ["wrong", "right"]
    t = tool(name="answer")(lambda target: answers.pop(0))
    t.args_model = tool(flaky([])).args_model
    result = make_agent(model, t, result_validator=lambda name, r: r == "right").run("answer")
    assert [r.error_type for r in result.trace.retries] == ["ResultRejected"]
    assert result.trace.tool_calls[0].result == "right" and len(result.trace.rollbacks) == 1


def test_unclassified_tool_errors_propagate(model: FreeTokenModel) -> None:
    fn = flaky([RuntimeError("bug in the tool")])
    with pytest.raises(ToolExecutionError) as info:
        make_agent(model, tool(fn)).run("ping")
    assert info.value.tool == "ping" and isinstance(info.value.__cause__, RuntimeError)
    assert "target" in str(info.value)


def test_timeout_is_retried_and_async_tools_work(model: FreeTokenModel) -> None:
    # The retry must finish inside the timeout: a fresh thread and event loop plus the tool took
    # over 0.1 s once on a loaded 2-core machine (two timeouts). 1 s leaves the margin; the first
    # call's task is cancelled at its timeout, so the test waits 1 s, not 30.
    delays = [30.0, 0.0]

    @tool(timeout=1.0)
    async def slow(target: Literal["db", "api"]) -> str:
        "A slow service."
        await asyncio.sleep(delays.pop(0))
        return "done"

    result = asyncio.run(make_agent(model, slow).arun("go"))
    assert [r.error_type for r in result.trace.retries] == ["ToolTimeout"]
    assert result.trace.tool_calls[0].result == "done" and result.trace.rollbacks == []


def test_stream_events_and_trace_json(model: FreeTokenModel) -> None:
    fn = flaky([ValueError("no")])
    agent = Agent(
        model,
        [tool(fn)],
        system_prompt="Be brief.",
        tool_choice="required",
        retry=FAST,
        max_new_tokens=3,
        max_steps=2,
    )
    events = list(agent.stream("ping"))
    kinds = [e.kind for e in events]
    assert kinds[-1] == "final" and {"anchor", "retry", "rollback", "tool_call", "tool_result"} <= set(kinds)
    trace = events[-1].data.trace
    again = Trace.model_validate_json(trace.to_json())
    assert again == trace and json.loads(trace.to_json())["tokens_saved_by_rollback"] > 0
    assert trace.tokens_prefilled > 0 and trace.tokens_decoded > 0


def test_type_errors_are_bugs_not_model_errors(model: FreeTokenModel) -> None:
    assert TypeError not in RetryPolicy().model_errors
    fn = flaky([TypeError("unsupported operand type(s) for +: 'int' and 'str'")])
    with pytest.raises(ToolExecutionError) as info:
        make_agent(model, tool(fn)).run("ping")
    assert fn.calls == 1 and isinstance(info.value.__cause__, TypeError)  # not retried


@pytest.mark.parametrize("error", [KeyError("db"), LookupError("no such host")])
def test_lookup_errors_go_back_to_the_model(model: FreeTokenModel, error: BaseException) -> None:
    fn = flaky([error])
    result = make_agent(model, tool(fn)).run("ping")
    assert fn.calls == 2 and [r.error_type for r in result.trace.retries] == ["ModelRetry"]
    assert len(result.trace.rollbacks) == 1


def test_pydantic_validation_error_inside_a_tool_goes_back_to_the_model(model: FreeTokenModel) -> None:
    class Port(BaseModel):
        number: int

    attempts = {"n": 0}

    def connect(target: Literal["db", "api"]) -> str:
        "Connect."
        attempts["n"] += 1
        Port.model_validate({"number": "eighty" if attempts["n"] == 1 else 80})
        return "connected"

    result = make_agent(model, tool(connect)).run("connect")
    assert attempts["n"] == 2 and "number" in result.trace.retries[0].error


def test_a_second_retry_keeps_the_first_failure_note_in_the_cache(model: FreeTokenModel) -> None:
    """Each retry rolls back to the call of the attempt that just failed, not to the first one:
    the notes of earlier failures stay in the KV cache, as they stay in the step's text."""
    fn = flaky([ValueError("first failure"), ValueError("second failure")])
    retry = RetryPolicy(model_attempts=3, initial_backoff=0.0, max_backoff=0.0)
    agent = make_agent(model, tool(fn), retry, isolate_runs=False)  # the model's context is read after
    result = agent.run("ping")
    assert fn.calls == 3
    first, second = result.trace.rollbacks
    assert second.to_position > first.to_position  # the first note was kept, not rolled back over
    kept = model.tokenizer.decode(model.token_ids[first.to_position : second.to_position])
    assert "first failure" in kept


def test_a_forced_call_that_cannot_fit_its_budget_raises_a_named_error(model: FreeTokenModel) -> None:
    @tool
    def pair(a: int, b: int, label: str) -> str:
        "Pair two numbers."
        return f"{label}: {a}, {b}"

    def agent(budget: int) -> Agent:
        settings = {"max_call_tokens": budget}
        return Agent(model, [pair], tool_choice="pair", retry=FAST, max_steps=2, model_settings=settings)

    with pytest.raises(
        TokenLimitTooSmall, match=r"max_call_tokens=1 is too small for a call to 'pair'"
    ) as info:
        agent(1).run("pair 1 and 2")
    needed = info.value.needed
    assert (info.value.limit, info.value.value) == ("max_call_tokens", 1) and needed > 1
    for budget in range(needed, needed + 4):  # from the smallest budget that works, the call closes
        result = agent(budget).run("pair 1 and 2")
        call = result.trace.tool_calls[0]
        assert result.trace.retries == [] and set(call.arguments) == {"a", "b", "label"}
        assert result.trace.steps[0].tokens_decoded <= budget
