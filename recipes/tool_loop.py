"""Tool loop: an `Agent` with two of the embedded model's tools, one of them flaky, driven by a
plain `for event in agent.stream(question)` loop that prints every event, then the trace.

The flaky `get_weather` raises a transient `RetryableToolError` on its first call: the agent
retries the tool itself (model state untouched), and the trace shows the tool-scope retry.

    freetoken recipe tool_loop [--model PATH] [--question TEXT] [--tool-choice get_weather]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from typing import Any

from freetoken_agents import Agent, AgentResult, FreeTokenModel, RetryableToolError, RetryPolicy, Tool
from freetoken_agents.agent import ToolChoicePolicy
from freetoken_agents.constrained import ToolChoice

from . import RECIPES, RecipeError
from ._common import Write, add_model_argument, load_model, recipe_main, stdout_write
from ._printing import AgentPrinter, trace_summary
from .tiny.world import SYSTEM_PROMPT, get_weather, lookup_capital, tool_question


def flaky(tool: Tool, failures: int = 1) -> Tool:
    """A copy of `tool` whose first `failures` calls raise RetryableToolError (a transient
    outage, as a flaky service has); the calls after them run the tool."""
    calls = 0

    def call(**arguments: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls <= failures:
            raise RetryableToolError(f"the {tool.name} service timed out (call {calls}); try again")
        return tool.fn(**arguments)

    return Tool(
        call, name=tool.name, description=tool.description, args_model=tool.args_model, timeout=tool.timeout
    )


def build_agent(
    model: FreeTokenModel,
    *,
    tool_choice: ToolChoice | ToolChoicePolicy = "auto",
    max_new_tokens: int = 96,
    failures: int = 1,
) -> Agent:
    """The recipe's Agent: tools `get_weather` (flaky) and `lookup_capital`, the embedded model's
    system prompt. `tool_choice` (auto, required, none or a tool name) applies to the first turn;
    a callable `tool_choice(step)` gives every turn's."""
    return Agent(
        model,
        [flaky(get_weather, failures), lookup_capital],
        system_prompt=SYSTEM_PROMPT,
        tool_choice=tool_choice,
        max_new_tokens=max_new_tokens,
        max_steps=4,
        retry=RetryPolicy(initial_backoff=0.05, max_backoff=0.2),
    )


def run_tool_loop(
    model: FreeTokenModel,
    question: str,
    *,
    tool_choice: ToolChoice | ToolChoicePolicy = "auto",
    max_new_tokens: int = 96,
    failures: int = 1,
    write: Write = stdout_write,
) -> AgentResult:
    """Run the agent on `question`, printing each event and then the trace summary."""
    agent = build_agent(model, tool_choice=tool_choice, max_new_tokens=max_new_tokens, failures=failures)
    printer = AgentPrinter(write)
    result: AgentResult | None = None
    for event in agent.stream(question):
        printer(event)
        if event.kind == "final":
            result = event.data
    if result is None:  # pragma: no cover - stream() raises instead of ending without a result
        raise RecipeError("the agent ended without a final answer")
    write(trace_summary(result.trace) + "\n")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--question", help="default: a held-out weather question of the embedded model")
    parser.add_argument("--seed", type=int, default=0, help="picks the held-out question (default 0)")
    parser.add_argument(
        "--tool-choice", default="auto", help="first turn: auto, required, none or a tool name (default auto)"
    )
    parser.add_argument("--failures", type=int, default=1, help="transient get_weather failures (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="per model turn (default 96)")


def run(args: argparse.Namespace, write: Write = stdout_write) -> int:
    question = args.question or tool_question(random.Random(args.seed), "heldout", "get_weather").question
    model = load_model(args)
    write(f"question: {question}\n")
    run_tool_loop(
        model,
        question,
        tool_choice=args.tool_choice,
        max_new_tokens=args.max_new_tokens,
        failures=args.failures,
        write=write,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m freetoken_agents.recipes.tool_loop ARGS`: this recipe as a program."""
    return recipe_main("tool_loop", RECIPES["tool_loop"], add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
