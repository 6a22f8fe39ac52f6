"""`freetoken simulate` without a trace file (--synthetic), one-line errors for a --model or trace
that does not fit, and a line per sweep budget on stderr (issue 65, item 5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from freetoken_agents.cli import main
from freetoken_agents.cli import simulate as cli_simulate
from freetoken_agents.engine.ftw.writer import FTWWriter
from freetoken_agents.engine.memory.routing_trace import write_trace
from freetoken_agents.engine.simulate.shapes import BUILTIN_CONFIGS
from freetoken_agents.engine.simulate.synthetic import MIXTRAL_8X7B, preset_trace

HW = ["--hardware", "rtx4090-pcie4", "--codec", "mxfp4"]
FEW = ["--policies", "static,belady"]


@pytest.fixture()
def trace(tmp_path: Path) -> str:
    path = tmp_path / "trace.jsonl"
    with path.open("w", encoding="utf-8") as f:
        write_trace(preset_trace(MIXTRAL_8X7B, tokens=8), f)
    return str(path)


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("freetoken simulate: error: ") and "\n" not in err, err
    return err


def test_synthetic_runs_without_a_trace_file(capsys) -> None:
    args = ["simulate", "--synthetic", "mixtral-8x7b", "--tokens", "8", *HW, *FEW, "--fast-mem", "0.5"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "mixtral-8x7b" and doc["decode_tokens"] == 8 and doc["simulated"] is True


def test_synthetic_names_are_the_presets() -> None:
    assert set(cli_simulate.SYNTHETIC_MODELS) <= set(BUILTIN_CONFIGS)
    for name in cli_simulate.SYNTHETIC_MODELS:
        assert cli_simulate._synthetic(name, 2, 0)


def test_synthetic_and_trace_together_is_a_usage_error(trace: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--trace", trace, "--synthetic", "mixtral-8x7b", *HW, "--fast-mem", "0.5"])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--synthetic: not allowed with argument --trace" in last


def test_neither_trace_nor_synthetic_says_both_ways(capsys) -> None:
    assert main(["simulate", "--model", "mixtral-8x7b", *HW, "--fast-mem", "0.5"]) == 1
    assert "missing --trace (or --synthetic MODEL)" in one_line_error(capsys)


def test_tokens_without_synthetic_is_refused(trace: str, capsys) -> None:
    args = ["simulate", "--trace", trace, "--model", "mixtral-8x7b", *HW, "--fast-mem", "0.5"]
    assert main([*args, "--tokens", "8"]) == 1
    assert "--tokens goes with --synthetic" in one_line_error(capsys)
    assert main(["simulate", "--synthetic", "mixtral-8x7b", "--tokens", "0", *HW, "--fast-mem", "0.5"]) == 1
    assert "--tokens must be at least 1" in one_line_error(capsys)


def test_model_may_be_an_ftw_file(trace: str, tmp_path: Path, capsys) -> None:
    ftw = tmp_path / "mixtral.ftw"
    with FTWWriter(ftw, model_config=BUILTIN_CONFIGS["mixtral-8x7b"]):
        pass
    args = ["simulate", "--trace", trace, "--model", str(ftw), *HW, *FEW, "--fast-mem", "0.5", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["decode_tokens"] == 8


def test_model_that_is_not_a_config_says_what_model_takes(trace: str, tmp_path: Path, capsys) -> None:
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"\x00\x81\xff" * 100)
    assert main(["simulate", "--trace", trace, "--model", str(blob), *HW, "--fast-mem", "0.5"]) == 1
    err = one_line_error(capsys)
    assert "not UTF-8" in err and "built-in name" in err and "FTW file" in err and "mixtral-8x7b" in err
    bad = tmp_path / "bad.ftw"
    bad.write_bytes(b"FTW1" + b"\x00" * 200)  # the magic, then no valid header
    assert main(["simulate", "--trace", trace, "--model", str(bad), *HW, "--fast-mem", "0.5"]) == 1
    assert str(bad) in one_line_error(capsys)


def test_a_trace_of_another_shape_names_both(trace: str, capsys) -> None:
    args = ["simulate", "--trace", trace, "--model", "qwen3-30b-a3b", *HW, "--fast-mem", "0.5"]
    assert main(args) == 1
    err = one_line_error(capsys)
    assert "does not fit qwen3-30b-a3b" in err
    assert "top-2 routing where qwen3-30b-a3b routes top-8" in err and "MoE layers 32-47" in err


def sweep(trace: str) -> list[str]:
    return ["simulate", "--trace", trace, "--model", "mixtral-8x7b", *HW, *FEW, "--fast-mem", "0.3:0.6:3"]


def test_a_sweep_prints_a_line_per_budget_off_a_terminal(trace: str, capsys) -> None:
    assert main(sweep(trace)) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert [line.split(":")[1].strip() for line in lines] == [f"budget {i}/3 done" for i in (1, 2, 3)]
    assert "budget" not in captured.out and captured.out.startswith("SIMULATED")
    assert main([*sweep(trace)[:-1], "0.3"]) == 0
    assert capsys.readouterr().err == ""  # one budget: no progress


def test_stdout_is_the_same_with_or_without_progress_lines(trace: str, capsys, monkeypatch) -> None:
    assert main(sweep(trace)) == 0
    lines = capsys.readouterr()
    monkeypatch.setattr(cli_simulate, "show_progress", lambda: True)  # a terminal: tqdm's bar
    assert main(sweep(trace)) == 0
    bar = capsys.readouterr()
    assert bar.out == lines.out and "budget 1/3" not in bar.err


def test_a_skipped_budget_gets_no_progress_line(trace: str, capsys) -> None:
    assert main([*sweep(trace)[:-1], "0.001:0.5:2"]) == 0
    err = capsys.readouterr().err
    assert "budget 2/2 done" in err and "budget 1/2" not in err and "skipped a budget" in err
