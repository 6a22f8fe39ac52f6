"""Soak: four agents at once, hundreds of tool calls, 30% of them failing, memory flat and every
run's trace adding up.

- Scripted (the Agent's loop is the point): 4 concurrent agents x 250 tool calls each (runs of 25),
  30% failing once: half model-caused (rolled back and regenerated), half transient (the tool is
  retried). Every run's trace must add up: calls, failures, rollbacks, retries, executions.
- The real engine (tiny random qwen3_moe): 4 concurrent agents sharing one FreeTokenModel, forced
  calls, 30% failing: every run in a context of its own, KV and anchors back to zero after each
  round and within the anchor budget during it, the Python heap flat.

`FREETOKEN_SOAK_CALLS` (default 250: per scripted agent) and `FREETOKEN_SOAK_ENGINE_CALLS` (default
30: per engine agent) scale it; `python bench/agent_soak.py` runs the full soak on the embedded
model and prints the figures.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import re
import sys
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from tiny_models import build_tiny_model

from freetoken_agents import (
    Agent,
    AgentResult,
    FreeTokenModel,
    GenerateRequest,
    RetryableToolError,
    RetryPolicy,
    Tool,
    tool,
)
from freetoken_agents.engine import Engine
from freetoken_agents.testing import ScriptedModel, ToolCall

AGENTS = 4
CALLS = int(os.environ.get("FREETOKEN_SOAK_CALLS", "250"))  # per scripted agent
ENGINE_CALLS = int(os.environ.get("FREETOKEN_SOAK_ENGINE_CALLS", "30"))  # per engine agent
PER_RUN = 25  # tool calls per scripted run; then a final answer and a fresh run
ENGINE_PER_RUN = 10
FAIL_SHARE = 0.3
MAX_ANCHORS = 16
FAST = RetryPolicy(initial_backoff=0.0, max_backoff=0.0)

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class Service:
    """The soak's flaky service: call (run, k) fails on its first execution as planned ("model":
    a ValueError, sent back to the model; "transient": a RetryableToolError, retried), then works."""

    seed: int
    plan: dict[tuple[int, int], str] = field(default_factory=dict)
    executions: dict[tuple[int, int], int] = field(default_factory=dict)

    def plan_run(self, run: int, calls: int) -> None:
        rng = random.Random(self.seed * 100_003 + run)
        failing = rng.sample(range(calls), round(FAIL_SHARE * calls))
        self.plan.update({(run, k): ("model", "transient")[i % 2] for i, k in enumerate(failing)})

    def tool(self) -> Tool:
        @tool
        def work(run: int, k: int) -> str:
            "Do piece k of a run's work."
            n = self.executions[(run, k)] = self.executions.get((run, k), 0) + 1
            kind = self.plan.get((run, k))
            if n == 1 and kind == "model":
                raise ValueError(f"piece {k} was asked for wrongly")
            if n == 1 and kind == "transient":
                raise RetryableToolError(f"piece {k}: the service is busy")
            return f"piece {k} of run {run} done"

        return work

    def forget(self, run: int) -> None:
        """Drop a checked run's records (the soak's heap must not grow with the test's own notes)."""
        for key in [key for key in self.executions if key[0] == run]:
            self.executions.pop(key)
            self.plan.pop(key, None)


def scripted_turn(request: GenerateRequest, context: str) -> Any:
    """Call `work` for the next piece (pieces done = tool results in the context), then answer."""
    run = int(re.search(r"<\|user\|>run (\d+)<\|end\|>", context).group(1))
    done = context.count("<|tool|>")
    return ToolCall("work", {"run": run, "k": done}) if done < PER_RUN else f"run {run}: all done"


def check_trace(result: AgentResult, service: Service, run: int, calls: int) -> tuple[int, int]:
    """Every count of the run's trace adds up; returns (model-caused, transient) failures."""
    trace = result.trace
    planned = [service.plan.get((run, k)) for k in range(calls)]
    model, transient = planned.count("model"), planned.count("transient")
    assert [(c.arguments["run"], c.arguments["k"]) for c in trace.tool_calls] == [
        (run, k) for k in range(calls)
    ]
    assert all(c.result == f"piece {c.arguments['k']} of run {run} done" for c in trace.tool_calls)
    assert sum(service.executions[(run, k)] for k in range(calls)) == calls + model + transient
    assert [r.scope for r in trace.retries].count("model") == model == len(trace.rollbacks)
    assert [r.scope for r in trace.retries].count("tool") == transient
    assert len(trace.steps) == calls + 1 and trace.steps[-1].final
    anchor_ids = {a.id for a in trace.anchors}
    assert all(rb.anchor_id in anchor_ids and not rb.rebuilt for rb in trace.rollbacks)
    assert trace.tokens_saved_by_rollback == sum(rb.tokens_saved for rb in trace.rollbacks)
    return model, transient


def heap_blocks(collect: Callable[[], None]) -> int:
    """Memory blocks the Python heap holds after `collect()` and a garbage collection: a count
    that grows with every object a leak keeps, with no cost while the soak runs (tracemalloc
    would slow the scripted soak threefold)."""
    collect()
    gc.collect()
    return sys.getallocatedblocks()


def assert_flat(heap: list[int], bound: int) -> None:
    """No growth from the first half of the checkpoints to the second beyond `bound`."""
    half = len(heap) // 2
    assert max(heap[half:]) - max(heap[:half]) < bound, heap


def test_four_scripted_agents_soak_with_30_percent_failures() -> None:
    services = [Service(seed) for seed in range(AGENTS)]
    models = [
        ScriptedModel([scripted_turn] * (4 * CALLS), chunk=64, max_anchors=MAX_ANCHORS) for _ in services
    ]
    agents = [
        Agent(model, [service.tool()], retry=FAST, max_steps=PER_RUN + 1)
        for model, service in zip(models, services, strict=True)
    ]
    runs = CALLS // PER_RUN
    totals = [0, 0, 0]  # calls, model-caused failures, transient failures

    async def agent_loop(i: int, first_run: int, count: int) -> None:
        for run in range(first_run, first_run + count):
            services[i].plan_run(run, PER_RUN)
            result = await agents[i].arun(f"run {run}")
            model, transient = check_trace(result, services[i], run, PER_RUN)
            services[i].forget(run)
            totals[0] += PER_RUN
            totals[1] += model
            totals[2] += transient
            assert len(models[i].anchors) <= MAX_ANCHORS

    async def round_of(first_run: int, count: int) -> None:
        await asyncio.gather(*(agent_loop(i, first_run, count) for i in range(AGENTS)))

    def forget_logs() -> None:  # the test double's own logs of every turn are not the agent's memory
        for m in models:
            m.requests.clear()
            m.contexts.clear()

    blocks: list[int] = []
    for first in range(0, runs, 2):
        asyncio.run(round_of(first, min(2, runs - first)))
        blocks.append(heap_blocks(forget_logs))
    assert totals[0] == AGENTS * runs * PER_RUN >= AGENTS * (CALLS - PER_RUN)
    assert totals[1] + totals[2] == AGENTS * runs * round(FAIL_SHARE * PER_RUN)
    print("heap blocks after each round:", blocks)
    assert_flat(blocks, 2000)


# ---- the real engine --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("agent_soak"), max_position_embeddings=4096)
    return Engine.from_pretrained(path)


def test_four_agents_on_one_engine_soak_with_30_percent_failures(engine: Engine) -> None:
    model = FreeTokenModel(engine, max_anchors=MAX_ANCHORS)
    store = engine.anchors
    budget = store.byte_budget
    assert budget is not None  # the default budget
    executions = [0] * AGENTS
    peak = {"anchors": 0, "used_bytes": 0}

    def ping_for(i: int) -> Tool:
        @tool(name="ping")
        def ping() -> str:
            "Ping the service."
            executions[i] += 1
            peak["anchors"] = max(peak["anchors"], len(store))
            peak["used_bytes"] = max(peak["used_bytes"], store.used_bytes)
            if executions[i] % 10 in (1, 4, 7):  # 30% of executions fail: rolled back and retried
                raise ValueError("the service is warming up")
            return "pong"

        return ping

    agents = [
        Agent(
            model,
            [ping_for(i)],
            tool_choice=lambda step: "ping" if step <= ENGINE_PER_RUN else "none",
            retry=FAST,
            max_new_tokens=1,
            max_steps=ENGINE_PER_RUN + 1,
        )
        for i in range(AGENTS)
    ]
    calls, rollbacks = [0] * AGENTS, [0] * AGENTS

    async def one_run_each() -> None:
        results = await asyncio.gather(*(a.arun("ping the service") for a in agents))
        for i, result in enumerate(results):
            trace = result.trace
            assert len(trace.tool_calls) == ENGINE_PER_RUN and trace.steps[-1].final
            assert [r.scope for r in trace.retries] == ["model"] * len(trace.rollbacks)
            calls[i] += len(trace.tool_calls)
            rollbacks[i] += len(trace.rollbacks)

    heap: list[int] = []
    tracemalloc.start()
    try:
        while min(calls) < ENGINE_CALLS:
            asyncio.run(one_run_each())
            # Every run's context was closed: no KV and no anchor outlives its run.
            assert engine.kv_pool.blocks_in_use == len(model.session.table.blocks) == 0
            assert len(store) == 0
            gc.collect()
            heap.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    for i in range(AGENTS):
        assert executions[i] == calls[i] + rollbacks[i]  # each failed execution was rolled back once
        assert rollbacks[i] >= 0.3 * executions[i] - 1  # 3 in every 10 executions fail
    # During the runs: each context's book holds at most MAX_ANCHORS, anchor-only KV the budget.
    assert peak["anchors"] <= AGENTS * MAX_ANCHORS and peak["used_bytes"] <= budget
    assert_flat(heap, 512 * 1024)
