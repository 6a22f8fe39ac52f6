"""The coding assistant recipe: `coding_solver.solve` on a task, its events printed (each
attempt's text with its anchors, the test outcome, the rollback and the note).

    freetoken recipe coding_assistant [--model PATH] [--task TEXT --tests FILE|-]

No `--task`: a held-out task of the embedded model (`tiny/coding.py`). `--tests`: a file of tests,
one assert per line (`-`: stdin). Never on a command line: any process may read another's argv
(/proc/PID/cmdline), sandboxed code at the process level included.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from . import RECIPES, RecipeError
from ._common import Write, add_model_argument, load_model, recipe_main, stdout_write
from ._printing import CodingPrinter
from .coding_solver import solve
from .sandbox import SandboxLimits
from .tiny.coding import code_task


class _NoTestOnArgv(argparse.Action):
    """The former `--test ASSERT`: refused with the way to go (and not taken as `--tests`)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        parser.error("--test is gone: tests on a command line can be read by any process; use --tests FILE|-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--task", help="your own task (default: a held-out task of the embedded model)")
    parser.add_argument("--tests", metavar="FILE", help="its tests: a file, one assert per line; - for stdin")
    parser.add_argument("--test", action=_NoTestOnArgv, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help="picks the held-out task (default 0)")
    parser.add_argument("--attempts", type=int, default=4, help="attempts in all (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=160, help="per attempt (default 160)")
    parser.add_argument("--temperature", type=float, default=0.7, help="of attempts after the first")
    parser.add_argument("--sampling-seed", type=int, default=0, help="seed of the sampled attempts")
    parser.add_argument("--prefix", default="", help="text the answer is made to start with")
    parser.add_argument("--isolation", choices=["auto", "namespaces", "process"], default="auto")
    parser.add_argument("--wall-time", type=float, default=5.0, help="sandbox wall-time limit, seconds")
    parser.add_argument("--json", action="store_true", help="print the CodingResult as JSON at the end")


def read_tests(source: str) -> list[str]:
    """The tests in file `source` ('-': stdin), one assert per line; blank lines and # comments
    skipped. RecipeError when it cannot be read or holds no test."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"cannot read the tests from {source}: {e}") from None
    tests = [t for t in (line.strip() for line in text.splitlines()) if t and not t.startswith("#")]
    if not tests:
        raise RecipeError(f"no tests in {source}: give one assert per line")
    return tests


def run(args: argparse.Namespace, write: Write = stdout_write) -> int:
    """`freetoken recipe coding_assistant`: exit code 0 when the code passed, 1 when not."""
    if bool(args.task) != bool(args.tests):
        raise RecipeError("--task and --tests go together: give a task and a file of tests")
    if args.task:
        prompt, tests = args.task, read_tests(args.tests)
    else:
        task = code_task(random.Random(args.seed), "heldout")
        prompt, tests = task.prompt, task.tests
    model = load_model(args)
    write(f"task: {prompt}\ntests: {'; '.join(tests)}\n")
    result = solve(
        model,
        prompt,
        tests,
        attempts=args.attempts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.sampling_seed,
        prefix=args.prefix,
        limits=SandboxLimits(wall_time_s=args.wall_time),
        isolation=args.isolation,
        on_event=CodingPrinter(write),
    )
    write(f"coding_assistant: {result.summary()}\n")
    if args.json:
        write(result.model_dump_json(indent=2) + "\n")
    return 0 if result.passed else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m freetoken_agents.recipes.coding_assistant ARGS`: this recipe as a program."""
    return recipe_main("coding_assistant", RECIPES["coding_assistant"], add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
