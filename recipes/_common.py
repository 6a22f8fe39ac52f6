"""What the recipes (and the `freetoken` command, which sits above them) share: `--model` (with
the engine's own flags, `engine.flags`), loading the model with them, the writer recipes print
through, and running a recipe as a program (`python -m freetoken_agents.recipes.NAME`) with
one-line errors.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from freetoken_agents import AgentError, default_model
from freetoken_agents.engine import EngineError, MemoryBudgetError
from freetoken_agents.engine.flags import MEMORY_FLAGS, add_engine_arguments, engine_options

from . import RecipeError

if TYPE_CHECKING:
    from freetoken_agents import FreeTokenModel

# Only light modules above: the `freetoken` command builds its parsers from this one, and
# `freetoken --help` must not wait for torch (issue 65). The model loads in `load_model`.

Write = Callable[[str], None]
"""Where recipe output goes: text in, nothing out (lines end with their own newline)."""

ERRORS: tuple[type[BaseException], ...] = (EngineError, AgentError, RecipeError, OSError, ValueError)
"""Errors a recipe program (and the CLI) prints as one line with exit code 1; anything else is a
bug and shows its traceback."""


def stdout_write(text: str) -> None:
    """The recipes' default writer: stdout, flushed at once so streamed text shows as it comes."""
    sys.stdout.write(text)
    sys.stdout.flush()


def model_path(path: str | Path | None) -> Path:
    """`path`, or the embedded model's when None (EmbeddedModelMissing if it is not installed)."""
    return Path(path) if path is not None else default_model()


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """`--model PATH` plus the engine arguments (`add_engine_arguments`)."""
    parser.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="Hugging Face checkpoint folder, .ftw file, or Hub id org/name[@revision] "
        "(default: the embedded model)",
    )
    add_engine_arguments(parser)


def load_model(args: argparse.Namespace) -> FreeTokenModel:
    """A FreeTokenModel over `args.model` (default: the embedded model) with the engine options
    of `args`."""
    from freetoken_agents import FreeTokenModel

    return FreeTokenModel.from_pretrained(model_path(args.model), **engine_options(args).as_kwargs())


def use_threads(threads: int | None, model: str | Path | None) -> None:
    """Torch's intra-op threads for a command: `threads` when given; else one thread for the
    embedded model (`model` None), whose matmuls are too small to gain from more (on a busy
    2-core machine, one thread ran the demo in half the time of two); else torch's default."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    elif model is None:
        torch.set_num_threads(1)


def one_line(error: BaseException) -> str:
    """The error's message on one line (multi-line messages joined with '; '); a memory budget
    error names the flag that sets the budget and the smallest value that works."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = "; ".join(lines) or type(error).__name__
    if isinstance(error, MemoryBudgetError) and error.option in MEMORY_FLAGS:
        from freetoken_agents.engine.memory.budget import format_size  # torch: only on this error

        flag = MEMORY_FLAGS[error.option]
        if error.minimum_bytes is not None:
            text += f" (give {flag} {format_size(error.minimum_bytes)} or more)"
        else:
            text = f"{flag}: {text}" if not text.startswith(flag) else text
    return text


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def recipe_main(
    name: str,
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None,
) -> int:
    """`python -m freetoken_agents.recipes.NAME ARGS`: parse, run, and print errors in `ERRORS`
    as one line (exit code 1; `--debug` shows the traceback), as `freetoken recipe NAME` does."""
    prog = f"python -m freetoken_agents.recipes.{name}"
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(message)s"
    )
    use_threads(args.threads, args.model)
    try:
        return int(run(args) or 0)
    except ERRORS as e:
        if args.debug:
            raise
        sys.stderr.write(f"{prog}: error: {one_line(e)}\n")
        return 1
    except KeyboardInterrupt:
        return 130
