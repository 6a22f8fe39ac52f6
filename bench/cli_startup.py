"""How long `freetoken --help` and each command's `--help` take, in fresh processes, against the
bare interpreter's start-up (the baseline, what no CLI can beat).

    python bench/cli_startup.py [--runs 10]

Runs the `freetoken` console script installed beside this interpreter (not a shell shim such as
pyenv's, whose own start-up is not ours), once to warm the page cache and then `--runs` times per
command, and prints the median wall time of each, its ratio to `python -c pass`, and the slowest
median against the 1 s target of issue 65. Which modules `--help` loads (no torch, no
transformers) is checked by tests/test_cli_startup.py; this script only times it.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_S = 1.0


def console_script() -> list[str]:
    """The command that runs `freetoken`: the script beside this interpreter, else the one on PATH."""
    beside = Path(sys.executable).with_name("freetoken")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("freetoken")
    if found is None:
        raise SystemExit("no `freetoken` console script: pip install -e . first")
    return [found]


def commands() -> list[str]:
    """The CLI's command names, read from its parser (light: the parsers import no torch)."""
    from freetoken_agents.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def median_s(argv: list[str], runs: int) -> float:
    """Median wall seconds of `argv` over `runs` fresh processes, after one untimed warm-up."""
    subprocess.run(argv, check=True, capture_output=True)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="timed runs per command (default 10)")
    args = parser.parse_args()

    script = console_script()
    baseline = median_s([sys.executable, "-c", "pass"], args.runs)
    print(f"{args.runs} runs each, medians; baseline `python -c pass`: {baseline * 1000:.0f} ms")
    print(f"{'command':<28} {'median ms':>10} {'x baseline':>11}")
    worst = 0.0
    for argv in (["--help"], *([name, "--help"] for name in commands())):
        took = median_s([*script, *argv], args.runs)
        worst = max(worst, took)
        print(f"{'freetoken ' + ' '.join(argv):<28} {took * 1000:>10.0f} {took / baseline:>10.1f}x")
    verdict = "under" if worst < TARGET_S else "OVER"
    print(f"slowest median {worst * 1000:.0f} ms: {verdict} the {TARGET_S:.0f} s target")


if __name__ == "__main__":
    main()
