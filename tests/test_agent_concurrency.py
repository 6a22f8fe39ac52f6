"""Concurrent runs each get exactly their own context and answers: 8 `arun` on one Agent, Agents
sharing a FreeTokenModel, FreeTokenModels sharing an Engine, threads and event loops mixed; runs
on a backend with one context (ScriptedModel) take turns, first come first served; a context
changed under a suspended turn raises ContextConflict instead of mixing."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from freetoken_agents import (
    Agent,
    AgentResult,
    ContextConflict,
    FreeTokenModel,
    GenerateRequest,
    default_model,
)
from freetoken_agents.recipes.tiny import world
from freetoken_agents.sync_bridge import TurnGate
from freetoken_agents.testing import ScriptedModel, ToolCall

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = [world.tool_question(random.Random(i), "heldout").question for i in range(8)]


@pytest.fixture(scope="module")
def embedded() -> FreeTokenModel:
    return FreeTokenModel.from_pretrained(default_model())


def make_agent(model: FreeTokenModel, **kw) -> Agent:
    return Agent(model, world.TOOLS, system_prompt=world.SYSTEM_PROMPT, max_new_tokens=10, max_steps=3, **kw)


def outcome(result: AgentResult) -> tuple:
    """Everything a run's answer is made of: the output, each call with its result, the anchors."""
    calls = [(c.tool, c.arguments, c.result) for c in result.trace.tool_calls]
    anchors = [(a.kind, a.position, a.step) for a in result.trace.anchors]
    return result.output, calls, anchors, len(result.trace.rollbacks), result.messages


@pytest.fixture(scope="module")
def alone(embedded: FreeTokenModel) -> list[tuple]:
    """Each question asked one at a time."""
    agent = make_agent(embedded)
    wanted = [outcome(agent.run(q)) for q in QUESTIONS]
    assert all(calls for _, calls, *_ in wanted)  # every question makes the model call a tool
    return wanted


def test_eight_concurrent_aruns_on_one_agent_get_their_one_at_a_time_outputs(embedded, alone) -> None:
    """The bug: the runs shared the model's one context, so answers carried other runs' tool
    calls. Each run now has a context of its own, 20 times in a row."""
    agent = make_agent(embedded)
    engine = embedded.engine

    async def eight() -> list[AgentResult]:
        return await asyncio.gather(*(agent.arun(q) for q in QUESTIONS))

    for _ in range(20):
        assert [outcome(r) for r in asyncio.run(eight())] == alone
        assert engine.kv_pool.blocks_in_use == 0 and len(engine.anchors) == 0  # contexts closed


def test_agents_sharing_one_model_in_threads_get_their_own_answers(embedded, alone) -> None:
    got: list = [None] * len(QUESTIONS)
    start = threading.Barrier(len(QUESTIONS))

    def ask(i: int) -> None:
        start.wait()
        got[i] = outcome(make_agent(embedded).run(QUESTIONS[i]))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone


def test_models_sharing_one_engine_in_threads_and_event_loops_get_their_own_answers(embedded, alone) -> None:
    """Four runs in threads (`run`) and four tasks on one event loop in another thread (`arun`),
    each Agent on a FreeTokenModel of its own over the one engine."""
    agents = [make_agent(FreeTokenModel(embedded.engine)) for _ in QUESTIONS]
    got: list = [None] * len(QUESTIONS)

    def in_thread(i: int) -> None:
        got[i] = outcome(agents[i].run(QUESTIONS[i]))

    def on_a_loop() -> None:
        async def four() -> list[AgentResult]:
            return await asyncio.gather(*(agents[i].arun(QUESTIONS[i]) for i in range(4, 8)))

        got[4:] = [outcome(r) for r in asyncio.run(four())]

    threads = [threading.Thread(target=in_thread, args=(i,)) for i in range(4)]
    threads.append(threading.Thread(target=on_a_loop))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone


def test_runs_that_share_the_models_own_context_take_turns(embedded, alone) -> None:
    """isolate_runs=False: the runs wait for each other on the model's one context (first come
    first served) and still get their one-at-a-time answers; the last run's context stays."""
    agent = make_agent(embedded, isolate_runs=False)

    async def eight() -> list[AgentResult]:
        return await asyncio.gather(*(agent.arun(q) for q in QUESTIONS))

    assert [outcome(r) for r in asyncio.run(eight())] == alone
    last = embedded.tokenizer.decode(embedded.token_ids)
    assert QUESTIONS[-1] in last and all(q not in last for q in QUESTIONS[:-1])


# ---- a backend with one context: runs take turns ------------------------------------------------------
def echo_script(n: int) -> list:
    """Turns that look at their context: call `echo` with the task found there, then answer with
    the tool's result. A mixed context shows as a wrong answer or a failed lookup."""

    def task_of(context: str) -> str:
        (task,) = [part.split("<|end|>")[0] for part in context.split("<|user|>")[1:]]  # exactly one
        return task

    def call(request: GenerateRequest, context: str) -> ToolCall:
        return ToolCall("echo", {"text": task_of(context)})

    def answer(request: GenerateRequest, context: str) -> str:
        result = context.rsplit("<|tool|>", 1)[1].split("<|end|>")[0]
        assert result == f"echo: {task_of(context)}"
        return f"answer to {task_of(context)}"

    return [call, answer] * n


def echo_tool():
    from freetoken_agents import tool

    @tool
    def echo(text: str) -> str:
        "Echo the text."
        return f"echo: {text}"

    return echo


def test_runs_on_a_single_context_backend_take_turns_in_arrival_order() -> None:
    tasks = [f"task {i}" for i in range(12)]
    model = ScriptedModel(echo_script(len(tasks)))
    agent = Agent(model, [echo_tool()])

    async def all_at_once() -> list[AgentResult]:
        return await asyncio.gather(*(agent.arun(t) for t in tasks))

    results = asyncio.run(all_at_once())
    assert [r.output for r in results] == [f"answer to {t}" for t in tasks]
    # First come first served: the runs played the script in the order they started.
    assert [c.count("<|user|>") for c in model.contexts] == [1] * (2 * len(tasks))
    assert [c.split("<|user|>")[1].split("<|end|>")[0] for c in model.contexts[::2]] == tasks


def test_threads_and_tasks_waiting_on_one_backend_all_finish_with_their_own_answers() -> None:
    """Twelve threads calling `run` and twelve tasks awaiting `arun`, on one ScriptedModel: nobody
    holds a thread while waiting, so however many wait, every run gets its turn."""
    model = ScriptedModel(echo_script(24))
    agents = [Agent(model, [echo_tool()]) for _ in range(3)]
    outputs: dict[str, str] = {}

    def in_thread(i: int) -> None:
        outputs[f"thread {i}"] = agents[i % 3].run(f"thread {i}").output

    async def tasks() -> None:
        results = await asyncio.gather(*(agents[i % 3].arun(f"task {i}") for i in range(12)))
        outputs.update({f"task {i}": r.output for i, r in enumerate(results)})

    threads = [threading.Thread(target=in_thread, args=(i,)) for i in range(12)]
    threads.append(threading.Thread(target=asyncio.run, args=(tasks(),)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outputs == {name: f"answer to {name}" for name in outputs} and len(outputs) == 24


# ---- the guard on one context, and contexts released ---------------------------------------------------
def test_a_context_changed_under_a_suspended_turn_raises_context_conflict(embedded) -> None:
    with embedded.new_context() as ctx:
        ctx.sync(ctx.render([{"role": "user", "content": "Hi"}], None))
        turn = ctx.generate(GenerateRequest(max_new_tokens=8))
        next(turn)
        ctx.append_text("someone else's words")  # another caller, between two steps of the turn
        with pytest.raises(ContextConflict, match="changed by another caller"):
            list(turn)


def test_contexts_are_independent_and_closing_one_releases_it(embedded) -> None:
    engine = embedded.engine
    embedded.reset()  # the model's own context holds nothing (an earlier test ran on it)
    a, b = embedded.new_context(), embedded.new_context()
    a.sync([5, 6, 7, 8])
    b.sync([9, 10])
    assert (a.token_ids, b.token_ids) == ([5, 6, 7, 8], [9, 10])
    a.anchor("manual")
    assert a.grammars() is b.grammars() is embedded.grammars()  # compiled once, shared
    a.close()
    b.close()
    assert engine.kv_pool.blocks_in_use == 0 and len(engine.anchors) == 0


async def test_a_stream_closed_early_closes_its_runs_context(embedded) -> None:
    engine = embedded.engine
    embedded.reset()
    stream = make_agent(embedded).astream(QUESTIONS[0])
    async for event in stream:
        if event.kind == "anchor":
            break
    await stream.aclose()
    assert engine.kv_pool.blocks_in_use == 0 and len(engine.anchors) == 0


# ---- TurnGate ----------------------------------------------------------------------------------------------
async def test_turn_gate_serves_threads_and_tasks_in_arrival_order() -> None:
    gate, order = TurnGate(), []
    await gate.acquire_async()
    arrived = threading.Event()

    def thread_waiter() -> None:
        arrived.set()
        gate.acquire()
        order.append("thread")
        gate.release()

    async def task_waiter(name: str) -> None:
        await gate.acquire_async()
        order.append(name)
        gate.release()

    first = asyncio.create_task(task_waiter("task 1"))
    await asyncio.sleep(0)  # task 1 is queued
    t = threading.Thread(target=thread_waiter)
    t.start()
    await asyncio.to_thread(arrived.wait)
    while len(gate._waiters) < 2:  # the thread is queued behind task 1
        await asyncio.sleep(0.001)
    second = asyncio.create_task(task_waiter("task 2"))
    await asyncio.sleep(0)
    gate.release()
    await asyncio.gather(first, second)
    await asyncio.to_thread(t.join)
    assert order == ["task 1", "thread", "task 2"] and not gate.held


async def test_turn_gate_waiter_cancelled_passes_its_turn_on() -> None:
    gate = TurnGate()
    await gate.acquire_async()
    cancelled = asyncio.create_task(gate.acquire_async())
    after = asyncio.create_task(gate.acquire_async())
    await asyncio.sleep(0)
    cancelled.cancel()
    gate.release()  # handed to the cancelled waiter or past it: either way `after` gets it
    await after
    assert cancelled.cancelled() and gate.held
    gate.release()
    assert not gate.held
