"""`freetoken simulate`: a routing trace replayed on a modelled machine, and `--profile-here`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from freetoken_agents.cli import main
from freetoken_agents.engine.memory.routing_trace import write_trace
from freetoken_agents.engine.simulate import measure
from freetoken_agents.engine.simulate.profiles import load_profile
from freetoken_agents.engine.simulate.simulator import POLICIES
from freetoken_agents.engine.simulate.synthetic import MIXTRAL_8X7B, preset_trace

BASE = ["--model", "mixtral-8x7b", "--hardware", "rtx4090-pcie4", "--codec", "mxfp4"]


@pytest.fixture()
def trace(tmp_path: Path) -> str:
    path = tmp_path / "trace.jsonl"
    with path.open("w", encoding="utf-8") as f:
        write_trace(preset_trace(MIXTRAL_8X7B, tokens=8), f)
    return str(path)


def run(trace: str, *extra: str) -> list[str]:
    return ["simulate", "--trace", trace, *BASE, *extra]


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("freetoken simulate: error: ") and "\n" not in err, err
    return err


def test_text_output_names_every_policy_and_says_simulated(trace: str, capsys) -> None:
    assert main(run(trace, "--fast-mem", "0.5")) == 0
    out = capsys.readouterr().out
    assert "SIMULATED" in out and "mixtral-8x7b" in out and "rtx4090-pcie4" in out and "mxfp4" in out
    assert "50% of the expert bytes" in out and "bound:" in out
    for policy in POLICIES:
        assert f"\n{policy} " in out, policy


def test_json_is_one_document_with_every_policy(trace: str, capsys) -> None:
    assert main(run(trace, "--fast-mem", "0.5", "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["simulated"] is True and len(doc["results"]) == len(POLICIES)
    assert doc["fast_fraction"] == pytest.approx(0.5, abs=1e-6)
    assert [r["policy"] for r in doc["results"]] == list(POLICIES)


def test_sweep_gives_one_report_per_budget(trace: str, capsys) -> None:
    assert main(run(trace, "--fast-mem", "0.3:0.6:2", "--json", "--policies", "layer-lru,static")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["simulated"] is True and len(doc["reports"]) == 2
    assert [round(r["fast_fraction"], 6) for r in doc["reports"]] == [0.3, 0.6]
    assert all(len(r["results"]) == 2 for r in doc["reports"])


def test_a_policy_that_needs_more_room_is_reported_not_run(trace: str, capsys) -> None:
    """layer-lru needs every layer's top-k in tier 1 (~27% of Mixtral's experts): at 10% it is
    reported infeasible while the others run; a budget below one layer's top-k is skipped."""
    assert main(run(trace, "--fast-mem", "0.1:0.5:2", "--json", "--policies", "layer-lru,static")) == 0
    doc = json.loads(capsys.readouterr().out)
    low, high = doc["reports"]
    assert low["results"][0]["tokens_per_s"] is None and "every layer" in low["results"][0]["infeasible"]
    assert low["results"][1]["tokens_per_s"] > 0 and high["results"][0]["tokens_per_s"] > 0
    assert main(run(trace, "--fast-mem", "0.001:0.5:2", "--json", "--policies", "qstar,static")) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["skipped"]) == 1 and "skipped a budget" in captured.err
    assert main(run(trace, "--fast-mem", "0.001:0.002:2")) == 1  # nothing fits: the error
    one_line_error(capsys)
    # The static splits need no tier-1 floor (llama.cpp's -cmoe keeps no expert on the device).
    assert main(run(trace, "--fast-mem", "0.001:0.5:2", "--json", "--policies", "static")) == 0
    assert not json.loads(capsys.readouterr().out)["skipped"]


def test_size_budgets(trace: str, capsys) -> None:
    assert main(run(trace, "--fast-mem", "12GB", "--host-mem", "20GiB", "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fast_bytes"] == 12_000_000_000 and doc["host_bytes"] == 20 * 2**30


@pytest.mark.parametrize("fast_mem", ["0.5", "0.3:0.9:3"])
def test_plot_writes_a_png(trace: str, tmp_path: Path, capsys, fast_mem: str) -> None:
    out = tmp_path / "out.png"
    assert main(run(trace, "--fast-mem", fast_mem, "--plot", str(out))) == 0
    assert out.read_bytes().startswith(b"\x89PNG")
    assert f"plot: {out}" in capsys.readouterr().out


def test_plot_without_matplotlib_says_how_to_install(trace: str, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    assert main(run(trace, "--fast-mem", "0.5", "--plot", str(tmp_path / "x.png"))) == 1
    assert "pip install 'freetoken-agents[plot]'" in one_line_error(capsys)


@pytest.mark.parametrize("where", ["missing/out.png", "."])
def test_a_plot_that_cannot_be_written_is_refused_before_the_replays(
    trace: str, tmp_path: Path, capsys, monkeypatch, where: str
) -> None:
    from freetoken_agents.engine.simulate import simulator  # the CLI imports it when it runs

    ran = []
    monkeypatch.setattr(simulator, "simulate", lambda *a, **kw: ran.append(1))
    assert main(run(trace, "--fast-mem", "0.1:0.9:9", "--plot", str(tmp_path / where))) == 1
    assert "--plot" in one_line_error(capsys)
    assert not ran  # a sweep's minutes of replays were lost to a typo in the plot's folder


def test_a_profile_that_cannot_be_written_is_refused_before_measuring(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    calls = []
    monkeypatch.setattr(measure, "measure_profile", lambda **kw: calls.append(kw))
    assert main(["simulate", "--profile-here", "--out", str(tmp_path / "missing" / "p.toml")]) == 1
    assert "--out" in one_line_error(capsys)
    assert not calls


def test_trace_of_another_model_is_one_line(trace: str, capsys) -> None:
    argv = ["simulate", "--trace", trace, "--model", "qwen3-30b-a3b", "--hardware", "rtx4090-pcie4"]
    assert main([*argv, "--fast-mem", "0.5"]) == 1
    one_line_error(capsys)


def test_malformed_trace_line_is_one_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"seq": 0, "token": 0}\n', encoding="utf-8")
    assert main(run(str(bad), "--fast-mem", "0.5")) == 1
    assert f"{bad}:1" in one_line_error(capsys)


def test_missing_options_are_named(trace: str, capsys) -> None:
    assert main(["simulate", "--trace", trace, "--model", "mixtral-8x7b"]) == 1
    err = one_line_error(capsys)
    assert "--hardware" in err and "--fast-mem" in err and "--model" not in err


@pytest.mark.parametrize("text", ["abc", "0", "1.5", "0.1:0.9", "0.9:0.1:3", "0.1:0.9:x"])
def test_bad_budget_text_is_an_argparse_error(trace: str, capsys, text: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(run(trace, "--fast-mem", text))
    assert exit_.value.code == 2
    assert "argument --fast-mem" in capsys.readouterr().err


def test_profile_here_is_exclusive_with_trace(trace: str, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", trace, "--profile-here"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_profile_here_writes_a_profile(tmp_path: Path, capsys, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out, scratch = tmp_path / "p.toml", tmp_path / "tmp"
    scratch.mkdir()
    assert (
        main(["simulate", "--profile-here", "--quick", "--out", str(out), "--scratch-dir", str(scratch)]) == 0
    )
    assert str(out) in capsys.readouterr().out
    profile = load_profile(out)
    assert profile.device == "cpu" and profile.cpu_cores >= 1
    calls = []
    monkeypatch.setattr(measure, "measure_profile", lambda **kw: calls.append(kw) or profile)
    assert main(["simulate", "--profile-here", "--model", "olmoe-1b-7b"]) == 0
    assert calls[-1]["matmul_k"] == 2048  # OLMoE's hidden size: memory read as its decode reads it
    # and its tiered overheads measured on its MoE layer: 64 experts, top-8
    assert (calls[-1]["moe_experts"], calls[-1]["moe_top_k"]) == (64, 8)
