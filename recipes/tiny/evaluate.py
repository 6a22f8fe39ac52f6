"""Measure the embedded model on held-out prompts (phrasings, names and values training never saw).

    python -m freetoken_agents.recipes.tiny.evaluate                    # the embedded model
    python -m freetoken_agents.recipes.tiny.evaluate --model build/tiny/model.ftw --tool-prompts 200

Reports, through the real engine and SDK:
- tool calls: the first assistant turn on a held-out question; exact tool name and arguments, and
  the share of valid calls, both free (the model's own text, parsed) and with the arguments
  grammar-constrained (what the Agent does);
- agent answers: `Agent.run` end to end (call, tool result, final answer); the answer must contain
  the tool's result;
- coding: held-out tasks solved by the coding-assistant recipe (sandboxed tests); passed on the
  first try, and after rollback-retries;
- generic tool use: the user's own tools, from held-out domains (`evaluate_generic.py`): right tool
  and exact arguments with tool_choice auto and forced, and direct answers when no tool fits.

`--ground`: every constrained call (the constrained tool calls, the agent's, the generic ones) with
grounded arguments (`freetoken_agents/grounding.py`: string arguments are spans of the request).
`--relevant-calls`: every turn the model decides (tool_choice auto) calls only the tools the request
is about or the model was trained on (`freetoken_agents/relevance.py`).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, Field
from tqdm.auto import tqdm

from freetoken_agents import Agent, FreeTokenModel, GenerateRequest, default_model

from .coding import code_task
from .corpus import TOOL_SCHEMAS
from .evaluate_generic import GenericScore, score_generic
from .world import SYSTEM_PROMPT, TOOLS, ToolQuestion, call_tool, tool_question

logger = logging.getLogger(__name__)


class ToolScore(BaseModel):
    """Tool-call accuracy on held-out questions."""

    prompts: int
    exact: float = Field(description="share with the right tool and exactly the right arguments")
    right_tool: float = Field(description="share naming the right tool")
    valid: float = Field(description="share with one complete call that validates against the tool")


class CodingScore(BaseModel):
    """Coding-assistant success on held-out tasks."""

    tasks: int
    first_try: float
    after_retries: float
    attempts: int = Field(description="attempts allowed per task")


class Evaluation(BaseModel):
    model: str
    tools_free: ToolScore
    tools_constrained: ToolScore
    agent_answers: float = Field(description="share of Agent.run answers containing the tool result")
    agent_prompts: int
    coding: CodingScore | None = None
    generic: GenericScore | None = None
    grounded: bool = Field(default=False, description="constrained calls had grounded arguments")
    relevant_calls: bool = Field(default=False, description="calls the model decided were gated by relevance")
    seconds: float


def _first_turn(
    model: FreeTokenModel, q: ToolQuestion, constrain: bool, system: bool, ground: bool, relevant: bool
) -> str:
    messages = ([{"role": "system", "content": SYSTEM_PROMPT}] if system else []) + [
        {"role": "user", "content": q.question}
    ]
    model.sync(model.render(messages, TOOL_SCHEMAS))
    sources = [q.question] if ground else None
    request = GenerateRequest(
        tools=TOOL_SCHEMAS,
        constrain=constrain,
        max_new_tokens=80,
        argument_sources=sources,
        call_sources=[q.question] if relevant else None,
    )
    return "".join(e.text for e in model.generate(request) if e.kind == "text")


def score_tool_calls(
    model: FreeTokenModel,
    questions: list[ToolQuestion],
    constrain: bool,
    ground: bool = False,
    relevant: bool = False,
) -> ToolScore:
    by_name = {t.name: t for t in TOOLS}
    exact = right = valid = 0
    label = "tools (constrained)" if constrain else "tools (free)"
    for i, q in enumerate(tqdm(questions, desc=label, leave=False)):
        text = _first_turn(model, q, constrain, system=i % 2 == 0, ground=ground, relevant=relevant)
        parsed = model.parser.parse(text, TOOL_SCHEMAS)
        if len(parsed.calls) != 1 or parsed.malformed or parsed.partial:
            continue
        call = parsed.calls[0]
        right += call.name == q.tool
        if call.name in by_name and isinstance(call.arguments, dict):
            try:
                by_name[call.name].validate(call.arguments)
                valid += 1
            except Exception:  # noqa: BLE001 - any validation failure counts as invalid
                pass
        exact += call.name == q.tool and call.arguments == q.arguments
    n = max(len(questions), 1)
    return ToolScore(prompts=n, exact=exact / n, right_tool=right / n, valid=valid / n)


def score_agent(
    model: FreeTokenModel, questions: list[ToolQuestion], ground: bool = False, relevant: bool = False
) -> float:
    """Share of end-to-end Agent runs whose answer contains the tool's result."""
    agent = Agent(
        model,
        TOOLS,
        system_prompt=SYSTEM_PROMPT,
        max_steps=3,
        max_new_tokens=80,
        ground_arguments=ground,
        relevant_calls=relevant,
    )
    good = 0
    for q in tqdm(questions, desc="agent", leave=False):
        model.reset()
        try:
            answer = agent.run(q.question).output
        except Exception as e:  # noqa: BLE001 - a failed run scores zero; say why in the log
            logger.info("agent run failed on %r: %s", q.question, e)
            continue
        result = call_tool(q.tool, q.arguments)
        expected = (
            str(result) if not isinstance(result, dict) else str(result.get("capital") or result["condition"])
        )
        good += expected in answer
    return good / max(len(questions), 1)


def score_coding(model: FreeTokenModel, tasks: int, attempts: int, seed: int) -> CodingScore:
    from ..coding_solver import solve

    rng = random.Random(seed)
    first = solved = 0
    for _ in tqdm(range(tasks), desc="coding", leave=False):
        task = code_task(rng, "heldout")
        model.reset()
        result = solve(model, task.prompt, task.tests, attempts=attempts, seed=seed)
        first += result.first_try_passed
        solved += result.passed
    return CodingScore(tasks=tasks, first_try=first / tasks, after_retries=solved / tasks, attempts=attempts)


def evaluate(
    model_path: Path,
    *,
    tool_prompts: int = 200,
    agent_prompts: int = 50,
    coding_tasks: int = 100,
    attempts: int = 4,
    generic_prompts: int = 200,
    direct_prompts: int = 60,
    seed: int = 1234,
    ground: bool = False,
    relevant: bool = False,
    progress: Callable[[str], None] = logger.info,
) -> Evaluation:
    t0 = time.perf_counter()
    # Both modes as asked, whatever the model's defaults (the embedded model's are on).
    model = FreeTokenModel.from_pretrained(model_path, ground_arguments=ground, relevant_calls=relevant)
    rng = random.Random(seed)
    questions = [tool_question(rng, "heldout") for _ in range(tool_prompts)]
    free = score_tool_calls(model, questions, constrain=False, relevant=relevant)
    progress(f"tools, free: {free}")
    constrained = score_tool_calls(model, questions, constrain=True, ground=ground, relevant=relevant)
    progress(f"tools, constrained: {constrained}")
    answers = score_agent(model, questions[:agent_prompts], ground, relevant)
    progress(f"agent answers: {answers:.3f}")
    coding = score_coding(model, coding_tasks, attempts, seed) if coding_tasks else None
    if coding:
        progress(f"coding: {coding}")
    generic = None
    if generic_prompts:
        generic = score_generic(model, generic_prompts, direct_prompts, seed, ground, relevant)
    if generic:
        progress(f"generic: {generic}")
    return Evaluation(
        model=str(model_path),
        tools_free=free,
        tools_constrained=constrained,
        agent_answers=answers,
        agent_prompts=agent_prompts,
        coding=coding,
        generic=generic,
        grounded=ground,
        relevant_calls=relevant,
        seconds=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="an .ftw file or HF folder (default: embedded)")
    p.add_argument("--tool-prompts", type=int, default=200)
    p.add_argument("--agent-prompts", type=int, default=50)
    p.add_argument("--coding-tasks", type=int, default=100)
    p.add_argument("--attempts", type=int, default=4)
    p.add_argument("--generic-prompts", type=int, default=200, help="held-out generic tool requests")
    p.add_argument("--direct-prompts", type=int, default=60, help="requests no offered tool serves")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ground", action="store_true", help="grounded arguments in every constrained call")
    p.add_argument("--relevant-calls", action="store_true", help="relevant tools only (auto)")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = evaluate(
        args.model or default_model(),
        tool_prompts=args.tool_prompts,
        agent_prompts=args.agent_prompts,
        coding_tasks=args.coding_tasks,
        attempts=args.attempts,
        generic_prompts=args.generic_prompts,
        direct_prompts=args.direct_prompts,
        seed=args.seed,
        ground=args.ground,
        relevant=args.relevant_calls,
    )
    text = json.dumps(result.model_dump(), indent=2)
    sys.stdout.write(text + "\n")
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
