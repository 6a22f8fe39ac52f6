"""The `freetoken` command line. Each subcommand lives in its own module with `register(subparsers)`.

Errors are printed as one line with a non-zero exit code; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ..engine import EngineError
from . import ftw, generate


class CLIError(Exception):
    """A user-facing command-line error (bad arguments, missing files)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freetoken", description="FreeToken: MoE agents on one machine.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _COMMANDS:
        module.register(sub)
    return parser


_COMMANDS = [generate, ftw]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.debug else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(message)s")
    try:
        return int(args.run(args) or 0)
    except (EngineError, CLIError, OSError, ValueError) as e:
        if args.debug:
            raise
        print(f"freetoken {args.command}: error: {e}", file=sys.stderr)  # noqa: T201
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
