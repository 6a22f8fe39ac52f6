"""The coding recipe's CLI keeps its tests off every command line: `--tests FILE` (or `-`, stdin)
replaces `--test ASSERT`, because a sandboxed solution at the process level can read its parent's
argv (/proc/PID/cmdline) and copy the expected values (security review finding)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from freetoken_agents.recipes import coding_assistant

TESTS = "assert inc(1) == 2\n\n# a comment\nassert inc(41) == 42\n"

# Reads the command line of every ancestor (and any file named there it can open), then answers
# inc() from the expected values it found: it implements nothing.
ATTACK = r"""
import os, re
seen, pid = "", os.getppid()
while pid > 1:
    try:
        seen += open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").replace("\0", "\n")
        pid = int(open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        break
for word in seen.split("\n"):
    try:
        seen += open(word).read()
    except Exception:
        pass
TABLE = {int(a): int(b) for a, b in re.findall(r"inc\((\d+)\) == (\d+)", seen)}
def inc(x):
    return TABLE[x]
"""
# The CLI with the model replaced by the attacker: solve() runs the real check_code on its code.
CLI = f"""
import sys
from freetoken_agents.recipes import coding_assistant as ca
from freetoken_agents.recipes.coding_solver import check_code
ATTACK = {ATTACK!r}
class Result:
    def __init__(self, run):
        self.passed, self.error = run.passed, run.error
    def summary(self):
        return f"passed={{self.passed}} error={{self.error}}"
ca.load_model = lambda args: None
ca.solve = lambda model, prompt, tests, **kw: Result(check_code(ATTACK, tests, isolation="process"))
sys.exit(ca.main(sys.argv[1:]))
"""
ON_ARGV = f"""
import sys
from freetoken_agents.recipes.coding_solver import check_code
print(check_code({ATTACK!r}, sys.argv[1:], isolation="process").passed)
"""
NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="the process level drops to another uid as root")


@pytest.fixture
def fake_solve(monkeypatch):
    """`solve` recording the tests the CLI gave it (no model involved)."""
    seen: list[list[str]] = []

    def solve(model, prompt, tests, **kwargs):
        seen.append(list(tests))
        return SimpleNamespace(passed=True, summary=lambda: "ok")

    monkeypatch.setattr(coding_assistant, "load_model", lambda args: None)
    monkeypatch.setattr(coding_assistant, "solve", solve)
    return seen


def test_judge_cli_reads_tests_from_a_file_or_stdin(fake_solve, tmp_path, monkeypatch, capsys):
    path = tmp_path / "tests.txt"
    path.write_text(TESTS)
    assert coding_assistant.main(["--task", "Write inc.", "--tests", str(path)]) == 0
    monkeypatch.setattr(sys, "stdin", io.StringIO(TESTS))
    assert coding_assistant.main(["--task", "Write inc.", "--tests", "-"]) == 0
    assert fake_solve == [["assert inc(1) == 2", "assert inc(41) == 42"]] * 2


def test_judge_cli_takes_no_tests_on_its_command_line(fake_solve, capsys):
    with pytest.raises(SystemExit) as exit_:
        coding_assistant.main(["--task", "Write inc.", "--test", "assert inc(1) == 2"])
    assert exit_.value.code == 2 and "--test is gone" in capsys.readouterr().err
    assert fake_solve == []


@pytest.mark.parametrize("content", [None, "", "# only a comment\n", b"\xff\xfe"])
def test_judge_cli_unreadable_or_empty_tests_are_one_line_errors(fake_solve, tmp_path, capsys, content):
    path = tmp_path / "tests.txt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert coding_assistant.main(["--task", "Write inc.", "--tests", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and ("no tests in" in err or "cannot read the tests" in err)
    assert fake_solve == []


def _run(args: list[str], stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=300, check=False
    )


@NEEDS_ROOT
def test_judge_cli_a_solution_cannot_copy_the_tests_from_its_parents(tmp_path: Path):
    control = _run(["-c", ON_ARGV, "assert inc(1) == 2", "assert inc(41) == 42"])
    assert control.stdout.strip() == "True", control.stderr  # the attack works when tests are on argv
    path = tmp_path / "tests.txt"
    path.write_text(TESTS)
    path.chmod(0o600)
    task = ["-c", CLI, "--task", "Write a function inc(x) returning x + 1."]
    for args, stdin in ((["--tests", str(path)], ""), (["--tests", "-"], TESTS)):
        run = _run(task + args, stdin)
        assert run.returncode == 1, run.stderr  # the tests ran, and failed
        assert "passed=False" in run.stdout and "KeyError: 1" in run.stdout
