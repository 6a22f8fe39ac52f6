"""The `freetoken` subcommands added for the recipes: demo, chat, recipe, bench, generate's
chunked prefill, and the one-line errors with their exit codes (tracebacks only with --debug)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import freetoken_agents.embedded as embedded
from freetoken_agents import EmbeddedModelMissing, default_model
from freetoken_agents.cli import bench, main
from freetoken_agents.engine import Engine
from freetoken_agents.recipes import RecipeError


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The embedded model is tiny: on a busy 2-core machine extra threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def one_line_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"freetoken {command}: error: ") and "\n" not in err, err
    return err


def test_help_lists_every_command() -> None:
    script = Path(sys.executable).with_name("freetoken")  # the installed console script
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("usage: freetoken")
    for command in ("demo", "chat", "recipe", "generate", "convert", "inspect", "bench"):
        assert re.search(rf"^\s+{command}\s", done.stdout, re.M), command


def test_unknown_recipe_is_one_line_and_debug_shows_the_error(capsys) -> None:
    assert main(["recipe", "nope"]) == 1
    assert "unknown recipe 'nope'; recipes: coding_assistant, tool_loop, langchain_agent" in one_line_error(
        capsys, "recipe"
    )
    with pytest.raises(RecipeError):
        main(["--debug", "recipe", "nope"])


def test_recipe_help_is_the_recipes_own(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["recipe", "coding_assistant", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: freetoken recipe coding_assistant") and "--tests FILE" in out


def test_recipe_argument_errors_are_one_line(capsys) -> None:
    assert main(["recipe", "coding_assistant", "--task", "Write f."]) == 1
    assert "--task and --tests go together" in one_line_error(capsys, "recipe")


def test_missing_embedded_model_is_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(embedded, "DEFAULT_MODEL_FILE", "stripped-install.ftw")  # as if not packaged
    with pytest.raises(EmbeddedModelMissing):
        default_model()
    assert main(["demo"]) == 1
    err = one_line_error(capsys, "demo")
    assert "the embedded model" in err and "stripped-install.ftw is missing" in err
    assert main(["recipe", "tool_loop"]) == 1
    assert "--model" in one_line_error(capsys, "recipe")


def test_bad_model_path_is_one_line(tmp_path, capsys) -> None:
    assert main(["chat", "--model", str(tmp_path / "missing")]) == 1
    assert "does not exist" in one_line_error(capsys, "chat")


def test_coding_assistant_recipe_runs_and_its_exit_code_says_if_the_code_passed(capsys) -> None:
    rc = main(["recipe", "coding_assistant", "--attempts", "2", "--max-new-tokens", "6", "--json"])
    out = capsys.readouterr().out
    result = json.loads(out[out.index("\n{") + 1 :])
    assert rc == (0 if result["passed"] else 1)
    assert out.startswith("task: ") and "attempt 1 (greedy)" in out
    assert f"coding_assistant: {'passed' if result['passed'] else 'failed'}" in out
    assert out.count("  rollback to anchor ") == len(result["rollbacks"])


def test_chat_reads_stdin_with_anchor_and_rollback(monkeypatch, capsys) -> None:
    script = (
        "Hello!\n/anchor first\nWhat is 2 plus 3?\n/anchors\n/rollback first\n/rollback nope\n/bogus\n/quit\n"
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    assert main(["chat", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> ") == 2
    anchor = re.search(r"\[anchor (\w+) 'first' at token (\d+), after 3 messages\]", out)
    assert anchor, out
    rollback = re.search(rf"\[rollback to {anchor[1]}: position (\d+) -> (\d+) \((\d+) tokens kept", out)
    assert rollback, out
    assert rollback[2] == rollback[3] == anchor[2] and int(rollback[1]) > int(anchor[2])
    assert "history back to 3 messages" in out
    assert f"{anchor[1]} manual 'first' at token {anchor[2]}" in out  # /anchors
    assert "[no anchor 'nope'; /anchors lists them]" in out
    assert "[unknown command /bogus; /help lists them]" in out


def test_chat_prefills_a_long_system_prompt_in_chunks(monkeypatch, capsys) -> None:
    system = " ".join(f"rule{i}" for i in range(120))  # over one 512-token chunk, within the context
    monkeypatch.setattr(sys, "stdin", io.StringIO("/anchors\n"))
    assert main(["chat", "--system", system, "--no-progress"]) == 0
    engine = Engine.from_pretrained(default_model())
    ids = engine.apply_chat_template([{"role": "system", "content": system}], add_generation_prompt=False)
    assert len(ids) > 512
    assert re.search(rf"^  \w+ system_prompt at token {len(ids)}$", capsys.readouterr().out, re.M)


def test_generate_prefills_a_long_prompt_in_chunks_with_the_same_result(capsys) -> None:
    prompt = " ".join(f"word{i}" for i in range(170))  # over one 512-token chunk, within the context
    assert main(["generate", "--prompt", prompt, "--max-new-tokens", "5"]) == 0
    engine = Engine.from_pretrained(default_model())
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    assert len(ids) > 512
    assert capsys.readouterr().out == engine.generate(ids, max_new_tokens=5).text + "\n"


def test_bench_runs_the_checkouts_script_with_this_python(monkeypatch, tmp_path, capfd) -> None:
    assert bench.bench_dir() == Path(__file__).resolve().parents[1] / "bench"
    assert main(["bench", "nope"]) == 1
    err = capfd.readouterr().err.strip()
    assert err.startswith("freetoken bench: error: no benchmark 'nope'") and "decode" in err
    folder = tmp_path / "bench"
    folder.mkdir()
    (folder / "echo.py").write_text("import sys\nprint(sys.executable, sys.argv[1:])\nsys.exit(3)\n")
    monkeypatch.setattr(bench, "bench_dir", lambda: folder)  # a script of ours instead of a real bench
    assert main(["bench", "echo", "--quick", "x"]) == 3
    assert capfd.readouterr().out.strip() == f"{sys.executable} ['--quick', 'x']"


def test_demo_runs_and_tells_what_happened(capsys) -> None:
    assert main(["demo", "--tasks", "1", "--attempts", "2", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "== 1. An agent with tools ==" in out and "== 2. Coding assistant" in out
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("demo summary: agent ")
    rollbacks = int(re.search(r"(\d+) rollbacks", summary)[1])
    assert out.split("== 2. Coding assistant")[1].count("  rollback to anchor ") == rollbacks
    assert ("no attempt failed in this run" in out) == (rollbacks == 0)
