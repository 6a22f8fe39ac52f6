"""The `freetoken` command line. Each subcommand lives in its own module with `register(subparsers)`.

Errors are printed as one line with a non-zero exit code; `--debug` shows the traceback.

Building the parser loads no torch, transformers, engine internals or integrations (issue 65:
`freetoken --help` took 6-28 s): a subcommand module imports at its top only what its parser
needs (`engine.choices`, `engine.flags`, `recipes._common`), and what its command runs inside the
function that runs it. tests/test_cli_startup.py checks it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ..recipes._common import ERRORS as RECIPE_ERRORS
from ..recipes._common import one_line, positive_int
from . import bench, chat, demo, ftw, generate, recipe, serve, simulate
from .common import CLIError

__all__ = ["CLIError", "build_parser", "main"]

ERRORS: tuple[type[BaseException], ...] = (*RECIPE_ERRORS, CLIError)
"""Errors `main()` prints as one line with exit code 1: EngineError (EmbeddedModelMissing and
MemoryBudgetError are EngineErrors), AgentError, RecipeError (SandboxError is one), CLIError,
OSError, ValueError; anything else is a bug and shows its traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freetoken", description="FreeToken: MoE agents on one machine.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument(
        "--threads", type=positive_int, default=None, help="torch threads (default: 1 for the embedded model)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _COMMANDS:
        module.register(sub)
    return parser


_COMMANDS = [demo, chat, recipe, generate, ftw, bench, serve, simulate]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.debug else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(message)s")
    try:
        return int(args.run(args) or 0)
    except ERRORS as e:
        if args.debug:
            raise
        print(f"freetoken {args.command}: error: {one_line(e)}", file=sys.stderr)  # noqa: T201
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
