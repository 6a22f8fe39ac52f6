"""LangChain agent: `langchain.agents.create_agent` over `ChatFreeToken` with two of the embedded
model's tools, printing the messages as the agent adds them. Needs `langchain` (pip install
'langchain>=1.0'); `ChatFreeToken` itself only needs `langchain-core`.

    freetoken recipe langchain_agent [--model PATH] [--question TEXT] [--tool-choice get_weather]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from langchain_core.messages import BaseMessage
from langchain_core.tools import tool

from freetoken_agents.engine import EngineOptions
from freetoken_agents.engine.flags import engine_options
from freetoken_agents.integrations.langchain import ChatFreeToken

from . import RECIPES, RecipeError
from ._common import Write, add_model_argument, model_path, recipe_main, stdout_write
from .tiny.world import SYSTEM_PROMPT, capital_of, tool_question, weather_report


@tool
def get_weather(city: str) -> dict[str, Any]:
    """Current weather for a city."""
    return weather_report(city)


@tool
def lookup_capital(country: str) -> dict[str, str]:
    """The capital city of a country."""
    return {"country": country, "capital": capital_of(country)}


TOOLS = [get_weather, lookup_capital]


ToolChoicePolicy = Callable[[int], str]
"""model call number (1-based) -> that call's tool_choice."""


def build_agent(
    model: str | Path | None = None,
    *,
    tool_choice: str | ToolChoicePolicy = "auto",
    max_tokens: int = 96,
    options: EngineOptions | None = None,
) -> Any:
    """A `create_agent` graph over ChatFreeToken(model) (default: the embedded model) and TOOLS.
    `tool_choice` (auto, any, none or a tool name) applies to the first model call, later ones
    are auto, so the agent can answer; a callable `tool_choice(n)` gives every call's. `options`:
    the engine's device, dtype, memory and placement (default: EngineOptions()).
    Raises RecipeError when `langchain` is not installed."""
    try:
        from langchain.agents import create_agent
        from langchain.agents.middleware import wrap_model_call
    except ImportError as e:
        raise RecipeError("the langchain_agent recipe needs LangChain: pip install 'langchain>=1.0'") from e
    options = options or EngineOptions()
    llm = ChatFreeToken(
        model=str(model_path(model)),
        max_tokens=max_tokens,
        device=options.device,
        dtype=str(options.dtype).removeprefix("torch."),
        memory=options.memory,
        placement=options.placement,
        expert_quant=options.expert_quant,
        record_routing=str(options.record_routing) if options.record_routing is not None else None,
        routing_profile=str(options.routing_profile) if options.routing_profile is not None else None,
    )
    policy = tool_choice if callable(tool_choice) else (lambda n: tool_choice if n == 1 else "auto")
    calls = 0

    @wrap_model_call
    def choose_tools(request: Any, handler: Any) -> Any:
        nonlocal calls
        calls += 1
        choice = policy(calls)
        return handler(request if choice == "auto" else request.override(tool_choice=choice))

    middleware = [choose_tools]
    return create_agent(llm, TOOLS, system_prompt=SYSTEM_PROMPT, middleware=middleware)


def run_langchain_agent(
    question: str,
    *,
    model: str | Path | None = None,
    tool_choice: str | ToolChoicePolicy = "auto",
    max_tokens: int = 96,
    recursion_limit: int = 12,
    write: Write = stdout_write,
    options: EngineOptions | None = None,
) -> list[BaseMessage]:
    """Run the agent on `question`, printing each message as it is added; returns them all."""
    agent = build_agent(model, tool_choice=tool_choice, max_tokens=max_tokens, options=options)
    messages: list[BaseMessage] = []
    config = {"recursion_limit": recursion_limit}
    for state in agent.stream({"messages": [("user", question)]}, config, stream_mode="values"):
        for message in state["messages"][len(messages) :]:
            write(message.pretty_repr() + "\n")
        messages = list(state["messages"])
    return messages


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--question", help="default: a held-out capital question of the embedded model")
    parser.add_argument("--seed", type=int, default=0, help="picks the held-out question (default 0)")
    parser.add_argument(
        "--tool-choice", default="auto", help="first call: auto, any, none or a tool name (default auto)"
    )
    parser.add_argument("--max-tokens", type=int, default=96, help="per model call (default 96)")


def run(args: argparse.Namespace, write: Write = stdout_write) -> int:
    question = args.question or tool_question(random.Random(args.seed), "heldout", "lookup_capital").question
    run_langchain_agent(
        question,
        model=args.model,
        tool_choice=args.tool_choice,
        max_tokens=args.max_tokens,
        write=write,
        options=engine_options(args),
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m freetoken_agents.recipes.langchain_agent ARGS`: this recipe as a program."""
    return recipe_main("langchain_agent", RECIPES["langchain_agent"], add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
