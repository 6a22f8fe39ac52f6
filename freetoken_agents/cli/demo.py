"""`freetoken demo`: on the embedded model, with no arguments, an agent answering a held-out
question with the model's tools, then the coding assistant on held-out tasks, printing the
anchors, every failed attempt, the rollback and the retry, and a one-line summary.

Nothing is staged: the tasks come from a fixed seed and whatever the model does is printed as it
happened; when no attempt fails, the demo says there was no rollback to show.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import TYPE_CHECKING

from ..engine.flags import engine_options
from ..errors import AgentError
from ..recipes._common import add_model_argument, model_path, positive_int, use_threads
from .common import model_label, write

if TYPE_CHECKING:
    from ..model import FreeTokenModel
    from ..recipes.coding_solver import CodingResult

# The agent, the model, the recipes and their torch load inside the functions that run the demo,
# never for `freetoken --help` (issue 65).

DEMO_SEED = 12
"""The one constant that picks the demo's held-out question and coding tasks."""
DEMO_CODING_TASKS = 2
"""How many held-out coding tasks the demo runs (drawn in order from `Random(DEMO_SEED)`)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="an agent with tools and the coding assistant with rollback, on the embedded model",
        description="Run an agent on a held-out question and the coding assistant on held-out "
        "tasks (tests in a sandbox, rollback to the code-block anchor on failure), printing what "
        "the model really does. A few seconds on 2 CPU cores.",
    )
    add_model_argument(p)
    p.add_argument("--seed", type=int, default=DEMO_SEED, help=f"picks question and tasks ({DEMO_SEED})")
    p.add_argument("--tasks", type=int, default=DEMO_CODING_TASKS, help="coding tasks to run")
    p.add_argument("--attempts", type=int, default=3, help="coding attempts per task (default 3)")
    p.add_argument("--max-new-tokens", type=positive_int, default=96, help="per model turn (default 96)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..model import FreeTokenModel

    t0 = time.perf_counter()
    use_threads(args.threads, args.model)
    path = model_path(args.model)
    model = FreeTokenModel.from_pretrained(path, **engine_options(args).as_kwargs())
    which = "the embedded model" if args.model is None else "model"
    label = model_label(args.model, path)
    write(f"FreeToken demo: {which} {label}, loaded in {time.perf_counter() - t0:.1f} s\n\n")
    agent_outcome = _agent_part(model, args.seed, args.max_new_tokens)
    results = _coding_part(model, args.seed, args.tasks, args.attempts, args.max_new_tokens)
    passed = sum(r.passed for r in results)
    after = sum(r.passed and not r.first_try_passed for r in results)
    write(
        f"\ndemo summary: agent {agent_outcome}; coding {passed}/{len(results)} passed "
        f"({passed - after} on the first try, {after} after a rollback), "
        f"{sum(len(r.anchors) for r in results)} anchors, {sum(len(r.rollbacks) for r in results)} "
        f"rollbacks, {sum(r.tokens_saved for r in results)} tokens kept by rollback; "
        f"{time.perf_counter() - t0:.1f} s\n"
    )
    return 0


def _agent_part(model: FreeTokenModel, seed: int, max_new_tokens: int) -> str:
    from ..agent import Agent, AgentResult
    from ..recipes._printing import AgentPrinter, trace_summary
    from ..recipes.tiny import world

    question = world.tool_question(random.Random(seed), "heldout")
    write("== 1. An agent with tools ==\n")
    write(f"tools: {', '.join(t.name for t in world.TOOLS)}\nquestion (held out): {question.question}\n")
    agent = Agent(
        model,
        world.TOOLS,
        system_prompt=world.SYSTEM_PROMPT,
        max_new_tokens=max_new_tokens,
        max_steps=3,
    )
    printer, result = AgentPrinter(write), None
    try:
        for event in agent.stream(question.question):
            printer(event)
            if event.kind == "final":
                result = event.data
    except AgentError as e:
        write(f"the agent failed: {type(e).__name__}: {e}\n\n")
        return f"failed ({type(e).__name__})"
    assert isinstance(result, AgentResult)
    write(trace_summary(result.trace) + "\n")
    rollbacks = len(result.trace.rollbacks)
    after = f" after {rollbacks} rollback{'s' if rollbacks != 1 else ''}" if rollbacks else ""
    expected = f"{question.tool}({json.dumps(question.arguments)})"
    calls = result.trace.tool_calls
    if not calls:
        write(f"the model answered without calling a tool (the expected call: {expected})\n\n")
        return f"answered without a tool call{after}"
    made = ", ".join(f"{c.tool}({json.dumps(c.arguments)})" for c in calls)
    right = any(c.tool == question.tool and c.arguments == question.arguments for c in calls)
    write(f"the model called {made}; expected {expected}: {'the same' if right else 'different'}\n\n")
    verdict = "as expected" if right else "not as expected"
    return f"called {', '.join(c.tool for c in calls)} ({verdict}){after}"


def _coding_part(
    model: FreeTokenModel, seed: int, tasks: int, attempts: int, max_new_tokens: int
) -> list[CodingResult]:
    from ..recipes._printing import CodingPrinter, answer_block
    from ..recipes.coding_solver import solve
    from ..recipes.tiny.coding import code_task

    write("== 2. Coding assistant: tests in a sandbox, rollback to the code-block anchor ==\n")
    rng, results = random.Random(seed), []
    for i in range(tasks):
        task = code_task(rng, "heldout")
        write(f"\ntask {i + 1} (held out): {task.prompt}\ntests: {'; '.join(task.tests)}\n")
        result = solve(
            model,
            task.prompt,
            task.tests,
            attempts=attempts,
            max_new_tokens=max_new_tokens,
            seed=seed,
            on_event=CodingPrinter(write),
        )
        answer_block(write, "final answer (the turn as the model's context holds it):", result.answer)
        write(f"task {i + 1}: {result.summary()}\n")
        results.append(result)
    if not any(r.rollbacks for r in results):
        write("\nno attempt failed in this run, so there was no rollback to show\n")
    return results
