"""The `freetoken` command line. Each subcommand lives in its own module with `register(subparsers)`.

Errors are printed as one line with a non-zero exit code; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ..engine import EngineError
from ..errors import AgentError
from ..recipes import RecipeError
from . import bench, chat, demo, ftw, generate, recipe
from .common import CLIError

__all__ = ["CLIError", "build_parser", "main"]

ERRORS: tuple[type[BaseException], ...] = (
    EngineError,
    AgentError,
    RecipeError,
    CLIError,
    OSError,
    ValueError,
)
"""Errors `main()` prints as one line with exit code 1 (EmbeddedModelMissing is an EngineError,
SandboxError a RecipeError); anything else is a bug and shows its traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freetoken", description="FreeToken: MoE agents on one machine.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument(
        "--threads", type=_positive, default=None, help="torch threads (default: 1 for the embedded model)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _COMMANDS:
        module.register(sub)
    return parser


_COMMANDS = [demo, chat, recipe, generate, ftw, bench]


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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def one_line(error: BaseException) -> str:
    """The error's message on one line (multi-line messages joined with '; ')."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return "; ".join(lines) or type(error).__name__


if __name__ == "__main__":
    sys.exit(main())
