"""Several tool calls in one turn: a failed call rolls back to the anchor before IT, the calls that
completed before it keep their text and results, and no completed call runs twice in a run.
Counting tools record every execution."""

from __future__ import annotations

from collections import Counter
from typing import Literal

import pytest
from tiny_models import build_tiny_model

from freetoken_agents import Agent, FreeTokenModel, GenerateRequest, RetryPolicy, tool
from freetoken_agents.engine import Engine
from freetoken_agents.testing import ScriptedModel, ToolCall

FAST = RetryPolicy(initial_backoff=0.0, max_backoff=0.0)


class Counting:
    """Tools that count their runs; `fail` maps (tool, run number) -> the error that run raises."""

    def __init__(self, fail: dict[tuple[str, int], BaseException] | None = None) -> None:
        self.runs: Counter[str] = Counter()
        self.log: list[tuple[str, str]] = []
        self.fail = dict(fail or {})

        @tool
        def record_visit(city: str) -> str:
            "Record that the user visited a city."
            return self._run("record_visit", city)

        @tool
        def lookup_code(city: str) -> str:
            "The airport code of a city."
            if city != city.strip().title() or city.endswith("nn"):
                self._run("lookup_code", city)
                raise ValueError(f"unknown city {city!r}")
            return self._run("lookup_code", city)

        @tool
        def notify(who: str) -> str:
            "Notify someone."
            return self._run("notify", who)

        self.tools = [record_visit, lookup_code, notify]

    def _run(self, name: str, arg: str) -> str:
        self.runs[name] += 1
        self.log.append((name, arg))
        error = self.fail.pop((name, self.runs[name]), None)
        if error is not None:
            raise error
        return f"{name}({arg}) done"


def tool_messages(result) -> list[tuple[str, str]]:
    return [(m["name"], m["content"]) for m in result.messages if m["role"] == "tool"]


def assistant_calls(result) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], c["function"]["arguments"])
        for m in result.messages
        if m["role"] == "assistant"
        for c in m.get("tool_calls") or []
    ]


def test_second_of_two_calls_fails_model_caused() -> None:
    """The issue's run: record_visit(Lisbon) completes, lookup_code(Lisbonn) raises ValueError."""
    tools = Counting()
    model = ScriptedModel(
        [
            [
                "Let me record it.",
                ToolCall("record_visit", {"city": "Lisbon"}),
                ToolCall("lookup_code", {"city": "Lisbonn"}),
            ],
            ToolCall("lookup_code", {"city": "Lisbon"}),
            "Recorded; the code is LIS.",
        ]
    )
    result = Agent(model, tools.tools, retry=FAST).run("I was in Lisbon; its code?")
    assert tools.runs == {"record_visit": 1, "lookup_code": 2}
    assert tools.log == [("record_visit", "Lisbon"), ("lookup_code", "Lisbonn"), ("lookup_code", "Lisbon")]
    # The final messages hold every completed call and its result.
    assert assistant_calls(result) == [
        ("record_visit", {"city": "Lisbon"}),
        ("lookup_code", {"city": "Lisbon"}),
    ]
    assert tool_messages(result) == [
        ("record_visit", "record_visit(Lisbon) done"),
        ("lookup_code", "lookup_code(Lisbon) done"),
    ]
    # The rollback went to the anchor before the failed call: the first call stayed in the context.
    (rollback,) = result.trace.rollbacks
    call_anchors = [a for a in result.trace.anchors if a.kind == "tool_call"]
    assert rollback.to_position == call_anchors[1].position > call_anchors[0].position
    turn = model.contexts[1].rsplit("<|assistant|>", 1)[1]  # the turn the retry continued
    assert turn.startswith("Let me record it.<tool_call>") and turn.count("<tool_call>") == 1
    assert '"record_visit"' in turn and '"Lisbonn"' not in turn
    assert turn.endswith("unknown city 'Lisbonn'. Call the tool again, fixing the problem.]")  # the note
    text = result.trace.steps[0].text
    assert text.startswith("[attempt 1 failed") and text.endswith("Let me record it.")


def test_second_of_three_calls_fails_model_caused() -> None:
    tools = Counting()
    model = ScriptedModel(
        [
            [
                ToolCall("record_visit", {"city": "Porto"}),
                ToolCall("lookup_code", {"city": "porto"}),
                ToolCall("notify", {"who": "ana"}),
            ],
            [ToolCall("lookup_code", {"city": "Porto"}), ToolCall("notify", {"who": "ana"})],
            "Done.",
        ]
    )
    result = Agent(model, tools.tools, retry=FAST).run("Porto trip")
    # The third call never ran in the failed attempt (calls run in order); each ran once in all.
    assert tools.runs == {"record_visit": 1, "lookup_code": 2, "notify": 1}
    assert [name for name, _ in assistant_calls(result)] == ["record_visit", "lookup_code", "notify"]
    assert [name for name, _ in tool_messages(result)] == ["record_visit", "lookup_code", "notify"]
    assert all("done" in content for _, content in tool_messages(result))
    (rollback,) = result.trace.rollbacks
    second = [a for a in result.trace.anchors if a.kind == "tool_call"][1]
    assert rollback.to_position == second.position


@pytest.mark.parametrize("calls", [2, 3])
def test_second_call_fails_transiently(calls: int) -> None:
    """A transient error retries the tool itself: no rollback, the first call ran once."""
    tools = Counting(fail={("lookup_code", 1): ConnectionError("reset")})
    turn = [ToolCall("record_visit", {"city": "Oslo"}), ToolCall("lookup_code", {"city": "Oslo"})]
    turn += [ToolCall("notify", {"who": "bo"})] * (calls - 2)
    model = ScriptedModel([turn, "ok"])
    result = Agent(model, tools.tools, retry=FAST).run("Oslo")
    assert tools.runs == {"record_visit": 1, "lookup_code": 2, **({"notify": 1} if calls == 3 else {})}
    assert result.trace.rollbacks == [] and [r.scope for r in result.trace.retries] == ["tool"]
    assert len(tool_messages(result)) == calls


def test_a_retry_that_fails_again_keeps_the_first_call() -> None:
    tools = Counting()
    model = ScriptedModel(
        [
            [ToolCall("record_visit", {"city": "Rome"}), ToolCall("lookup_code", {"city": "rome"})],
            ToolCall("lookup_code", {"city": "Romenn"}),
            ToolCall("lookup_code", {"city": "Rome"}),
            "ok",
        ]
    )
    result = Agent(model, tools.tools, retry=RetryPolicy(model_attempts=3)).run("Rome")
    assert tools.runs == {"record_visit": 1, "lookup_code": 3}
    first, second = result.trace.rollbacks
    assert second.to_position > first.to_position  # the first note stays in the context
    assert [name for name, _ in tool_messages(result)] == ["record_visit", "lookup_code"]
    assert model.contexts[2].count("[attempt") == 2


def test_calls_behind_one_marker_are_not_run_twice() -> None:
    """Mistral puts several calls in one list (one marker, one anchor): the rollback lands before
    the completed call too, and when the model writes it again its recorded result is reused."""
    tools = Counting()
    listing = (
        '[TOOL_CALLS][{{"name": "record_visit", "arguments": {{"city": "Kyiv"}}}}, '
        '{{"name": "lookup_code", "arguments": {{"city": "{}"}}}}]'
    )
    model = ScriptedModel([listing.format("kyiv"), listing.format("Kyiv"), "ok"], family="mistral")
    result = Agent(model, tools.tools, retry=FAST).run("Kyiv")
    assert tools.runs == {"record_visit": 1, "lookup_code": 2}
    assert [name for name, _ in tool_messages(result)] == ["record_visit", "lookup_code"]
    assert tool_messages(result)[0][1] == "record_visit(Kyiv) done"


def test_validate_reaches_every_rollback() -> None:
    tools = Counting()
    model = ScriptedModel(
        [
            [ToolCall("record_visit", {"city": "Bern"}), ToolCall("lookup_code", {"city": "bern"})],
            ToolCall("lookup_code", {"city": "Bern"}),
            "ok",
        ]  # fmt: skip
    )
    Agent(model, tools.tools, retry=FAST, validate="full").run("Bern")
    assert model.validations == ["full"]
    again = ScriptedModel(model.turns)
    Agent(again, Counting().tools, retry=FAST).run("Bern")
    assert again.validations == [None]  # unset: the model's own default


# ---- the same on the real engine: several constrained calls in one "auto" turn -----------------------
TOOL_CALL_ID = 3  # "<tool_call>" in the tiny tokenizer


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("agent_calls"), max_position_embeddings=4096)
    return Engine.from_pretrained(path)


def test_engine_turn_with_two_calls_rolls_back_to_the_second(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny random model is pushed to start calls (logit bias on <tool_call>) in the first
    step's attempts; the arguments are decoded under the schema. The 2nd call of the turn fails
    once: the rollback goes to the anchor before it and the 1st call is never run again."""
    model = FreeTokenModel(engine, validate="full")
    generate, requests = model.generate, []

    def biased(request: GenerateRequest):
        requests.append(request)
        if len(requests) <= 2:  # the first step's two attempts call; later steps answer
            request = request.model_copy(update={"logit_bias": {TOOL_CALL_ID: 100.0}})
        return generate(request)

    monkeypatch.setattr(model, "generate", biased)
    runs: list[str] = []
    contexts: list[list[int]] = []

    @tool
    def ping(target: Literal["db", "api"]) -> str:
        "Ping a service."
        runs.append(target)
        contexts.append(model.token_ids)
        if len(runs) == 2:
            raise ValueError("that service is down, try again")
        return f"{target} ok"

    # isolate_runs=False: the run uses the model's own context (patched generate, token_ids read in the tool)
    agent = Agent(model, [ping], retry=FAST, max_new_tokens=2, max_steps=3, isolate_runs=False)
    result = agent.run("ping both")
    step = result.trace.steps[0]
    anchors = [a for a in result.trace.anchors if a.kind == "tool_call" and a.step == 1]
    (rollback,) = result.trace.rollbacks
    assert rollback.to_position == anchors[1].position and not rollback.rebuilt  # before the 2nd call
    assert len(runs) == 4  # call 1, call 2 (fails), then the retry's two calls: call 1 not rerun
    assert [c.result for c in step.tool_calls] == [f"{t} ok" for t in (runs[0], runs[2], runs[3])]
    assert len([m for m in result.messages if m["role"] == "tool"]) == 3
    retried_in = contexts[2]  # the context the retry's first call ran in
    kept = model.tokenizer.decode(retried_in[anchors[0].position : rollback.to_position])
    assert kept.count("<tool_call>") == 1 and '"name": "ping"' in kept
