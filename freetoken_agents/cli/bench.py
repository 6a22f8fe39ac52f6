"""`freetoken bench NAME [ARGS]`: run the source checkout's `bench/NAME.py` with this Python."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from .common import CLIError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run a benchmark script of the source checkout (bench/NAME.py)",
        description="Run bench/NAME.py of the source checkout with this Python, passing ARGS on "
        "(e.g. `freetoken bench decode --quick`). Needs the checkout (an editable install).",
    )
    p.add_argument("name", metavar="NAME", help="the script's name, without .py")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(run=run)


def bench_dir() -> Path:
    """The checkout's bench/ folder. CLIError when this install has no source checkout."""
    root = Path(__file__).resolve().parents[2]
    folder = root / "bench"
    if not (root / "pyproject.toml").is_file() or not folder.is_dir():
        raise CLIError(
            f"benchmarks live in the source checkout (bench/NAME.py), and there is none at {root}: "
            "clone the repository and `pip install -e .` to run them"
        )
    return folder


def run(args: argparse.Namespace) -> int:
    folder = bench_dir()
    script = folder / f"{args.name}.py"
    if Path(args.name).name != args.name or not script.is_file():
        names = ", ".join(sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")))
        raise CLIError(f"no benchmark {args.name!r} in {folder}; benchmarks: {names}")
    return subprocess.run([sys.executable, str(script), *args.args], cwd=folder.parent).returncode
