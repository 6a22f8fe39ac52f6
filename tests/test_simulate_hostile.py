"""`freetoken simulate` under hostile inputs (issue 59, items 9 and 14): a long trace is streamed,
never held whole, and every bad trace line, profile value or model config is one line naming
file:line, exit code 1, no traceback."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import tracemalloc
from collections import deque
from pathlib import Path

import pytest

from freetoken_agents.cli import main
from freetoken_agents.engine.memory import routing_trace
from freetoken_agents.engine.memory.routing_trace import RoutingRecord, RoutingTraceError, write_trace
from freetoken_agents.engine.simulate.builtin_models import BUILTIN_CONFIGS
from freetoken_agents.engine.simulate.profiles import BUILTIN_PROFILES, load_profile
from freetoken_agents.engine.simulate.replay import TieredReplay
from freetoken_agents.engine.simulate.shapes import shape_for
from freetoken_agents.engine.simulate.source import TraceSource
from freetoken_agents.engine.simulate.synthetic import MIXTRAL_8X7B, preset_trace, synthetic_trace

LAYERS = 2  # a 2-layer Mixtral: replays of thousands of tokens in a second or two


@pytest.fixture()
def tiny_model(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(BUILTIN_CONFIGS["mixtral-8x7b"], num_hidden_layers=LAYERS)))
    return str(path)


def tiny_trace(path: Path, tokens: int) -> str:
    records = synthetic_trace(
        layers=LAYERS, num_experts=8, top_k=2, tokens=tokens, reuse=0.375, skew=0.35, cross_layer=0.0, seed=0
    )
    with path.open("w", encoding="utf-8") as f:
        write_trace(records, f)
    return str(path)


def simulate_argv(trace: str, model: str, *extra: str, hardware: str = "rtx4090-pcie4") -> list[str]:
    return [
        "simulate",
        "--trace",
        trace,
        "--model",
        model,
        "--hardware",
        hardware,
        "--codec",
        "mxfp4",
        *extra,
    ]


def one_line_error(capsys: pytest.CaptureFixture[str], where: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"freetoken simulate: error: {where}: ") and "\n" not in err, err
    assert "Traceback" not in err
    return err


# ---- item 9: the trace is streamed ----------------------------------------------------------


def test_the_cli_never_holds_the_traces_records_or_steps(
    tmp_path: Path, tiny_model: str, capsys, monkeypatch
):
    """The CLI read every record into a list and grouped them all into steps before the first
    replay (~47.5 KB a Qwen3-30B-A3B token): every record of the trace was alive at once. Counted
    by the records and steps the reader makes: a handful at a time, whatever the trace's length."""
    live = {"records": 0, "steps": 0}
    most = dict(live)

    def counted(base: type, name: str) -> type:
        def post_init(self) -> None:
            live[name] += 1
            most[name] = max(most[name], live[name])

        def delete(self) -> None:
            live[name] -= 1

        return dataclasses.dataclass(frozen=True)(
            type(base.__name__, (base,), {"__post_init__": post_init, "__del__": delete})
        )

    monkeypatch.setattr(routing_trace, "RoutingRecord", counted(RoutingRecord, "records"))
    monkeypatch.setattr(routing_trace, "Step", counted(routing_trace.Step, "steps"))
    trace = tiny_trace(tmp_path / "t.jsonl", tokens=200)
    assert main(simulate_argv(trace, tiny_model, "--fast-mem", "0.5", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["decode_tokens"] == 200
    assert most["records"] <= 2 * LAYERS, most  # 400 before: the whole trace
    assert most["steps"] <= 8, most  # 200 before


def test_memory_per_token_stays_a_few_bytes_per_routed_expert(tmp_path: Path, tiny_model: str, capsys):
    """Peak traced memory of `freetoken simulate` (Belady, and both bounds) on 40 and 160 tokens:
    it grew ~2,900 bytes a token of this 2-layer top-2 model (records, steps, each bound's keyed
    copy, Belady's heap of every use); streamed, what grows is Belady's next uses, 4 bytes per
    routed expert (16 a token here; ~90 measured while this short trace's bounded structures still
    fill). The cyclic collector is off while measuring: a full collection empties the freelists,
    whose refills tracemalloc would count as growth; a warm-up run fills them first."""
    small, large = (tiny_trace(tmp_path / f"t{n}.jsonl", n) for n in (40, 160))
    argv = ["--fast-mem", "0.5", "--policies", "belady", "--json"]

    def peak(trace: str) -> int:
        tracemalloc.start()
        try:
            assert main(simulate_argv(trace, tiny_model, *argv)) == 0
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    assert main(simulate_argv(large, tiny_model, *argv)) == 0  # warm-up
    gc.disable()
    try:
        per_token = (peak(large) - peak(small)) / 120
    finally:
        gc.enable()
    capsys.readouterr()
    assert per_token < 400, per_token


def test_a_replay_keeps_nothing_per_step(tmp_path: Path, tiny_model: str) -> None:
    """`TieredReplay` kept every (step, layer)'s missed experts for the bound (800 lists after 400
    tokens of 2 layers); the bound now counts them as the replay runs (`run(on_layer=...)`).
    Nothing it holds grows with the trace: no list, dict or set past a few dozen entries (this
    model has 16 experts in all; bandwidth windows are capped), bounded deques aside."""
    shape = shape_for(tiny_model)
    replay = TieredReplay(
        shape,
        load_profile("rtx4090-pcie4"),
        codec="mxfp4",
        fast_bytes=shape.total_expert_bytes("mxfp4") // 2,
        host_bytes=None,
    )
    tally = replay.run(TraceSource(tiny_trace(tmp_path / "t.jsonl", 400)))
    assert tally.tokens == 400
    seen: set[int] = set()
    stack: list[object] = [replay]
    largest = 0
    while stack:  # every container reachable through the replay's own objects
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, list | dict | set) or (isinstance(obj, deque) and obj.maxlen is None):
            largest = max(largest, len(obj))
        if isinstance(obj, dict):
            stack += obj.values()
        elif isinstance(obj, list | tuple | set | deque):
            stack += obj
        elif type(obj).__module__.startswith("freetoken_agents"):
            stack += vars(obj).values() if hasattr(obj, "__dict__") else []
            stack += [getattr(obj, k) for k in getattr(type(obj), "__slots__", ()) if hasattr(obj, k)]
    assert largest < 100, largest


def test_a_trace_file_that_changes_between_passes_is_refused(tmp_path: Path) -> None:
    path = Path(tiny_trace(tmp_path / "t.jsonl", tokens=3))
    source = TraceSource(path)
    assert sum(1 for _ in source) == 3
    with path.open("a", encoding="utf-8") as f:
        f.write(path.read_text(encoding="utf-8").splitlines()[0] + "\n")
    with pytest.raises(RoutingTraceError, match=r"changed while it was simulated$"):
        list(source)


def test_a_fifo_is_refused_not_waited_on(tmp_path: Path, tiny_model: str, capsys) -> None:
    """The trace is read once per pass: a FIFO gives its bytes once (and blocks with no writer)."""
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    assert main(simulate_argv(str(fifo), tiny_model, "--fast-mem", "0.5")) == 1
    assert "not a regular file" in capsys.readouterr().err


def test_a_prefill_step_wider_than_tier_1_replays(tmp_path: Path, capsys) -> None:
    """A prefill step routes up to every expert of a layer at once; with tier 1 at its minimum
    (one layer's top-k) Belady's cache popped an empty heap: an IndexError traceback."""
    records = [
        dataclasses.replace(r, phase="prefill" if r.token < 8 else "decode")
        for r in preset_trace(MIXTRAL_8X7B, tokens=12, seed=0)
    ]
    path = tmp_path / "prefill.jsonl"
    with path.open("w", encoding="utf-8") as f:
        write_trace(records, f)
    argv = simulate_argv(str(path), "mixtral-8x7b", "--fast-mem", "0.008", "--policies", "belady", "--json")
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["decode_tokens"] == 4 and doc["bound"]["tokens_per_s"] > 0


# ---- item 14: one line naming file:line -----------------------------------------------------

GOOD_LINE = '{"seq":0,"token":0,"layer":0,"experts":[0,1],"weights":[0.5,0.5],"phase":"decode"}'


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("[" * 200_000 + "]" * 200_000, "nested too deeply"),
        ('{"seq":' + "9" * 5001 + "}", "a number too long to read"),
        (b'{"seq":0,\xff\xfe}', "not UTF-8 text (byte 0xff at column 10)"),
        ("x" * (2 << 20), "line longer than 1048576 bytes"),  # no newline: never read whole
        (GOOD_LINE.replace('"seq":0', '"seq":' + "9" * 4000), "seq must be an integer >= 0 and below 2**63"),
    ],
    ids=["deep", "digits", "utf8", "long", "huge-int"],
)
def test_a_bad_trace_line_is_one_line_naming_file_and_line(
    tmp_path: Path, capsys, bad: str | bytes, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes((GOOD_LINE + "\n").encode() + (bad if isinstance(bad, bytes) else bad.encode()) + b"\n")
    assert main(simulate_argv(str(path), "mixtral-8x7b", "--fast-mem", "0.5")) == 1
    err = one_line_error(capsys, f"{path}:2")
    assert message in err and len(err) < 300


def _profile_text(**change: str) -> str:
    """The built-in RTX 4090 profile as TOML with `change`d keys (a key it leaves out, as the
    engine's measured costs, appended at the end)."""
    lines = [line for line in BUILTIN_PROFILES["rtx4090-pcie4"].to_toml().splitlines()]
    for key, value in change.items():
        if not any(line.startswith(f"{key} = ") for line in lines):
            lines.append(f"{key} = {value}")
        lines = [f"{key} = {value}" if line.startswith(f"{key} = ") else line for line in lines]
    return "\n".join(lines) + "\n"


AFTER_PROFILE = len(_profile_text().splitlines()) + 1  # the first line past a whole profile


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        (_profile_text(link_gbps="1e-320"), 3, "key 'link_gbps' must be 0.001 to 100000 GB/s, got 1e-320"),
        (_profile_text(link_gbps="2e5"), 3, "key 'link_gbps' must be 0.001 to 100000 GB/s"),
        (_profile_text(cpu_cores="9" * 5001), 13, "a number too long to read"),
        (_profile_text(cpu_cores="9" * 4000), 13, "key 'cpu_cores' must be 1 to 65536 cores, got 999"),
        (_profile_text(disk_gbps="nan"), 11, "key 'disk_gbps' must be finite"),
        (
            _profile_text(stream_overhead_us="1e-320"),
            AFTER_PROFILE,
            "key 'stream_overhead_us' must be 0 or 1e-06 to 1e+06 us",
        ),
        (_profile_text() + "x = " + "[" * 5_000 + "]" * 5_000 + "\n", AFTER_PROFILE, "nested too deeply"),
        (_profile_text() + "x = " + "[" * 100_000 + "]" * 100_000 + "\n", AFTER_PROFILE, "past 65536 bytes"),
        (_profile_text().encode() + b"# \xff\xfe\n", AFTER_PROFILE, "not UTF-8 text (byte 0xff)"),
    ],
    ids=[
        "denormal",
        "too-fast",
        "digits",
        "huge-int",
        "nan",
        "denormal-overhead",
        "deep",
        "100k-deep",
        "utf8",
    ],
)
def test_a_bad_profile_is_one_line_naming_file_and_line(
    tmp_path: Path, capsys, text: str | bytes, line: int, message: str
) -> None:
    trace = tmp_path / "t.jsonl"
    with trace.open("w", encoding="utf-8") as f:
        write_trace(preset_trace(MIXTRAL_8X7B, tokens=2), f)
    profile = tmp_path / "p.toml"
    profile.write_bytes(text if isinstance(text, bytes) else text.encode())
    argv = simulate_argv(str(trace), "mixtral-8x7b", "--fast-mem", "0.5", hardware=str(profile))
    assert main(argv) == 1
    err = one_line_error(capsys, f"{profile}:{line}")
    assert message in err and len(err) < 300


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b'{"model_type": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "JSON nested too deeply"),
        (b'{"model_type": "mixtral", "x": ' + b"9" * 5001 + b"}", "a number too long to read"),
        (b'{"model_type": "\xff"}', "not UTF-8 text"),
    ],
    ids=["deep", "digits", "utf8"],
)
def test_a_bad_model_config_is_one_line_naming_the_file(tmp_path: Path, capsys, text: bytes, message: str):
    config = tmp_path / "config.json"
    config.write_bytes(text)
    assert (
        main(
            [
                "simulate",
                "--trace",
                "t.jsonl",
                "--model",
                str(config),
                "--hardware",
                "h200",
                "--fast-mem",
                "0.5",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err.strip()
    assert err == f"freetoken simulate: error: cannot read model config {config}: {message}", err
