"""`freetoken recipe NAME [ARGS]`: run one of the ready programs of `freetoken_agents.recipes`
(`freetoken recipe NAME --help` lists its own arguments)."""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

from ..recipes import RECIPES, RecipeError
from ..recipes._common import use_threads
from .common import write


def register(sub: argparse._SubParsersAction) -> None:
    listing = "\n".join(f"  {name:<18} {text}" for name, text in RECIPES.items())
    p = sub.add_parser(
        "recipe",
        help="run a recipe (coding_assistant, tool_loop, langchain_agent) on the embedded model",
        description="Run a recipe. Each takes --model PATH (default: the embedded model); "
        "`freetoken recipe NAME --help` shows its arguments.",
        epilog=f"recipes:\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", metavar="NAME", help="the recipe: " + ", ".join(RECIPES))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the recipe's own arguments")
    p.set_defaults(run=run)


def recipe_parser(name: str) -> tuple[argparse.ArgumentParser, ModuleType]:
    """The argument parser and module of recipe `name`. RecipeError for an unknown name."""
    if name not in RECIPES:
        raise RecipeError(f"unknown recipe {name!r}; recipes: {', '.join(RECIPES)}")
    module = importlib.import_module(f"freetoken_agents.recipes.{name}")
    parser = argparse.ArgumentParser(prog=f"freetoken recipe {name}", description=RECIPES[name])
    module.add_arguments(parser)
    return parser, module


def run(args: argparse.Namespace) -> int:
    parser, module = recipe_parser(args.name)
    options = parser.parse_args(args.args)
    use_threads(args.threads, options.model)
    return int(module.run(options, write) or 0)
