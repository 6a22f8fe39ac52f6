"""The recipes end to end on the embedded model, through the real engine (short settings).

Nothing here depends on the model being good: where a path must be taken whatever the model
writes, the test forces it (a code fence in the answer's prefix, tests that always fail, a tool
choice), and the model's own tokens are only checked for what any model produces."""

from __future__ import annotations

import json
import random

import pytest
import torch

from freetoken_agents import FreeTokenModel, default_model
from freetoken_agents.recipes._coding_format import CODING_SYSTEM_PROMPT, code_failure_note
from freetoken_agents.recipes.coding_solver import CodingEvent, CodingResult, solve
from freetoken_agents.recipes.langchain_agent import run_langchain_agent
from freetoken_agents.recipes.tiny.coding import code_task
from freetoken_agents.recipes.tiny.world import weather_report
from freetoken_agents.recipes.tool_loop import run_tool_loop

PROMPT = "Write a Python function `f(x)` that returns x plus 1."
PREFIX = "Sure:\n```python\n"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The embedded model is tiny: on a busy 2-core machine extra threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> FreeTokenModel:
    return FreeTokenModel.from_pretrained(default_model())


def fresh_logits(model: FreeTokenModel, ids: list[int]) -> torch.Tensor:
    with model.engine.new_session() as s:
        return s.prefill(ids, last_only=True)[-1]


def test_every_attempt_fails_and_rolls_back_to_its_code_block_anchor(model: FreeTokenModel) -> None:
    prefixes: dict[str, list[int]] = {}  # anchor id -> the context when it was placed
    kv_checked: list[int] = []
    saved_before = model.usage().saved_by_rollback

    def watch(event: CodingEvent) -> None:
        if event.kind == "anchor":
            assert model.position == event.data.position
            prefixes[event.data.id] = model.token_ids
        elif event.kind == "rollback":
            assert model.token_ids == prefixes[event.data.anchor_id]  # exactly the anchored prefix
            torch.testing.assert_close(
                model.next_logits(), fresh_logits(model, model.token_ids), rtol=1e-4, atol=1e-4
            )  # the KV kept by the rollback equals a fresh prefill of the kept tokens
            kv_checked.append(event.data.to_position)

    tests = ["assert False, 'this test always fails'"]
    result = solve(model, PROMPT, tests, attempts=3, max_new_tokens=6, prefix=PREFIX, on_event=watch)

    assert not result.passed and not result.first_try_passed and len(result.attempts) == 3
    assert [a.seed for a in result.attempts] == [None, 1, 2]
    assert [a.temperature for a in result.attempts] == [0.0, 0.7, 0.7]
    assert all(a.code is not None and a.sandbox is not None and a.error for a in result.attempts)
    kinds = [a.kind for a in result.anchors]
    assert kinds == ["system_prompt", "manual", "code_block", "code_block", "code_block"]
    fences = [a for a in result.anchors if a.kind == "code_block"]
    assert len(result.rollbacks) == 2 and kv_checked == [f.position for f in fences[:2]]
    for rollback, fence in zip(result.rollbacks, fences, strict=False):
        assert rollback.anchor_id == fence.id and rollback.to_position == fence.position
        assert rollback.tokens_saved == fence.position and not rollback.rebuilt
        assert rollback.tokens_discarded == rollback.from_position - fence.position > 0
    assert result.tokens_saved == fences[0].position + fences[1].position
    assert model.usage().saved_by_rollback - saved_before == result.tokens_saved
    # After each rollback the failure note, in the exact training format, precedes the next fence.
    notes = [code_failure_note(i + 1, a.error) for i, a in enumerate(result.attempts[:2])]
    assert result.answer.startswith("Sure:\n" + "".join(notes) + "```python\n")
    answer_start = result.anchors[1].position
    for note, before, after in zip(notes, fences, fences[1:], strict=False):
        kept = model.tokenizer.decode(prefixes[before.id][answer_start:])
        note = note if kept.endswith("\n") else "\n" + note  # the anchor may sit before a "\n"
        assert prefixes[after.id][before.position :] == model.tokenizer.encode(note, add_special_tokens=False)
    assert CodingResult.model_validate_json(result.model_dump_json()).tokens_saved == result.tokens_saved


def test_right_code_passes_on_the_first_try(model: FreeTokenModel) -> None:
    answer = PREFIX + "def f(x):\n    return x + 1\n```"
    result = solve(model, PROMPT, ["assert f(1) == 2", "assert f(-1) == 0"], prefix=answer, max_new_tokens=4)
    assert result.passed and result.first_try_passed and len(result.attempts) == 1
    assert result.rollbacks == [] and result.tokens_saved == 0
    assert result.attempts[0].code == "def f(x):\n    return x + 1\n"
    assert [a.kind for a in result.anchors] == ["system_prompt", "manual", "code_block"]


def test_solve_on_a_held_out_task_keeps_its_invariants(model: FreeTokenModel) -> None:
    task = code_task(random.Random(0), "heldout")
    events: list[str] = []
    result = solve(
        model, task.prompt, task.tests, attempts=2, max_new_tokens=8, on_event=lambda e: events.append(e.kind)
    )
    assert 1 <= len(result.attempts) <= 2 and result.passed == result.attempts[-1].passed
    assert len(result.rollbacks) == len(result.attempts) - 1
    assert result.anchors[0].kind == "system_prompt" and result.anchors[1].label == "answer"
    assert {r.anchor_id for r in result.rollbacks} <= {a.id for a in result.anchors}
    assert events.count("attempt") == len(result.attempts) and events.count("rollback") == len(
        result.rollbacks
    )
    # The context the model ends with is the prompt as rendered, then the answer.
    prompt_ids = model.render(
        [{"role": "system", "content": CODING_SYSTEM_PROMPT}, {"role": "user", "content": task.prompt}], None
    )
    assert model.token_ids[: len(prompt_ids)] == prompt_ids
    assert result.tokens_decoded == sum(a.tokens_decoded for a in result.attempts)


def test_tool_loop_retries_the_flaky_tool(model: FreeTokenModel) -> None:
    lines: list[str] = []
    result = run_tool_loop(
        model,
        "What is the weather in Doubar?",
        tool_choice=lambda step: "get_weather" if step == 1 else "none",
        max_new_tokens=6,
        write=lines.append,
    )
    trace = result.trace
    assert [c.tool for c in trace.tool_calls] == ["get_weather"]
    call = trace.tool_calls[0]
    assert call.result == weather_report(call.arguments["city"])
    assert [(r.scope, r.error_type) for r in trace.retries] == [("tool", "RetryableToolError")]
    assert trace.rollbacks == []  # a transient tool error leaves the model's state alone
    kinds = [a.kind for a in trace.anchors]
    assert kinds[:3] == ["system_prompt", "tool_call", "tool_result"] and set(kinds[3:]) <= {"code_block"}
    out = "".join(lines)
    assert "call get_weather(" in out and "retrying the tool" in out and "final answer:" in out
    assert out.rstrip().splitlines()[-1].startswith("trace: 2 steps, 1 tool calls")


def test_langchain_agent_calls_a_tool_and_answers() -> None:
    lines: list[str] = []
    messages = run_langchain_agent(
        "What is the weather in Doubar?",
        tool_choice=lambda n: "get_weather" if n == 1 else "none",
        max_tokens=6,
        write=lines.append,
    )
    kinds = [m.type for m in messages]
    assert kinds == ["human", "ai", "tool", "ai"]
    call = messages[1].tool_calls[0]
    assert call["name"] == "get_weather"
    assert json.loads(messages[2].content) == weather_report(call["args"]["city"])
    assert not messages[3].tool_calls
    assert "".join(lines).count("Message ===") == 4
