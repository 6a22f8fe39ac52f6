"""A memory limit (the engine's KV budget) stopping a turn: the SDK's turn loops deliver what was
produced and end with finish_reason "memory" (as the engine's own stream_tokens does); the Agent,
which cannot go on, raises MemoryLimitReached naming the limit and carrying the partial output."""

from __future__ import annotations

import pytest

from freetoken_agents import Agent, FreeTokenModel, GenerateRequest, MemoryLimitReached
from freetoken_agents.engine import Engine, MemoryBudget

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCKS = 5  # KV blocks of 16 tokens the bounded engine may hold
PROMPT = [5, 9, 2, 7, 1, 3, 8, 4, 6, 10]


@pytest.fixture(scope="module")
def engines(tiny_checkpoint) -> tuple[Engine, Engine]:
    """(unbounded, bounded to BLOCKS KV blocks) engines of one tiny model."""
    folder = tiny_checkpoint("qwen3_moe")
    free = Engine.from_pretrained(folder)
    bounded = Engine.from_pretrained(
        folder, memory=MemoryBudget(kv_bytes=BLOCKS * free.kv_pool.bytes_per_block)
    )
    return free, bounded


def no_stop(engine: Engine) -> dict[int, float]:
    """logit_bias that keeps the random model from ending its turn early."""
    return {t: -1e4 for t in engine.default_stop_token_ids()}


def turn(model: FreeTokenModel, **kw) -> tuple[str, str | None]:
    text, finish = "", None
    for event in model.generate(GenerateRequest(max_new_tokens=400, logit_bias=no_stop(model.engine), **kw)):
        if event.kind == "text":
            text += event.text
        elif event.kind == "done":
            finish = event.finish_reason
    return text, finish


def test_a_turn_stopped_by_the_kv_budget_delivers_what_it_produced(engines) -> None:
    """The bug: the engine's MemoryBudgetError escaped the turn and its tokens were lost."""
    free, bounded = engines
    full_model, cut_model = FreeTokenModel(free), FreeTokenModel(bounded)
    full_model.sync(PROMPT)
    cut_model.sync(PROMPT)
    full, full_finish = turn(full_model)
    cut, cut_finish = turn(cut_model)
    assert (full_finish, cut_finish) == ("length", "memory")
    assert cut and full.startswith(cut) and len(cut) < len(full)
    # The context holds every token that fit plus the last one sampled (pending, never run).
    assert cut_model.position == BLOCKS * bounded.kv_pool.block_size + 1
    assert cut_model.token_ids == full_model.token_ids[: cut_model.position]
    cut_model.close()
    full_model.close()


def test_structured_output_stopped_by_the_kv_budget_ends_with_memory(engines) -> None:
    _, bounded = engines
    schema = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}}}
    with FreeTokenModel(bounded) as model:
        model.sync(PROMPT)
        events = list(model.decode_json(schema, max_tokens=400))
    assert events[-1].kind == "done" and events[-1].finish_reason == "memory"
    assert "".join(e.text for e in events if e.kind == "text").startswith("{")


def test_an_agent_stopped_by_the_kv_budget_raises_a_named_error_with_the_partial_output(engines) -> None:
    free, bounded = engines
    settings = {"logit_bias": no_stop(free), "max_new_tokens": 400}
    model = FreeTokenModel(bounded)
    with pytest.raises(MemoryLimitReached, match="stopped by the memory limit") as caught:
        Agent(model, model_settings=settings).run("Say something long.")
    error = caught.value
    # The same turn on the unbounded engine starts with what the bounded one produced.
    with FreeTokenModel(free) as reference:
        reference.sync(reference.render([{"role": "user", "content": "Say something long."}], None))
        full, _ = turn(reference)
    assert error.partial_output and full.startswith(error.partial_output)
    assert error.trace.steps[-1].text == error.partial_output and error.trace.tokens_decoded > 0
    assert repr(error.partial_output[:20])[1:-1] in str(error)
    model.close()
    assert bounded.kv_pool.blocks_in_use == 0  # the run's context was closed, the model's own too


def test_a_task_too_long_for_the_kv_budget_raises_the_named_error(engines) -> None:
    _, bounded = engines
    with pytest.raises(MemoryLimitReached, match="stopped by the memory limit") as caught:
        Agent(FreeTokenModel(bounded)).run("word " * 30)  # 104 tokens: more than the 80 that fit
    assert caught.value.partial_output == ""
