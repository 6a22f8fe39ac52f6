"""Recording routing traces (`record_routing=PATH`, `--record-routing`): one line per (token, MoE
layer) of everything the engine runs, equal to the model's own router output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken_agents.cli import main
from freetoken_agents.engine import Engine, EngineError, MemoryBudget, TieringOptions
from freetoken_agents.engine.flags import add_engine_arguments, engine_options
from freetoken_agents.engine.loading.calibrate import RoutingCounter
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.memory.routing_record import RoutingRecorder
from freetoken_agents.engine.memory.routing_trace import RoutingRecord, read_trace
from freetoken_agents.engine.model.experts import DelegatingStore, ExpertStore
from freetoken_agents.engine.model.moe import MoEBlock

pytestmark = pytest.mark.usefixtures("one_thread")

ARCH = "qwen3_moe"
PROMPT = [3, 17, 5, 9, 1, 12, 30]


def router_spy(engine: Engine) -> list[tuple[int, list[list[int]], list[list[float]]]]:
    """Every MoE block pass of `engine` as (layer, expert ids, weights), computed independently by
    the block's router on the hidden states the block got (a wrapper of the block's `forward`,
    which the decoder layer calls: the tiered store also calls the routers, to pre-gate)."""
    calls: list[tuple[int, list[list[int]], list[list[float]]]] = []

    def spy(block: MoEBlock) -> None:
        forward = block.forward

        def spied(x: torch.Tensor) -> torch.Tensor:
            ids, weights = block.router(x)
            calls.append((block.layer, ids.tolist(), weights.float().tolist()))
            return forward(x)

        block.forward = spied  # type: ignore[method-assign]

    for layer in engine.model.layers:
        if isinstance(layer.mlp, MoEBlock):
            spy(layer.mlp)
    return calls


def expected_records(calls, seq: int, starts: list[int]) -> list[tuple]:
    """The records the spied router calls make, pass by pass (`starts`: each pass's first position)."""
    out, moe = [], None
    passes = iter(starts)
    start = 0
    for layer, ids, ws in calls:
        if moe is None or layer <= moe:
            start = next(passes)
        moe = layer
        phase = "prefill" if len(ids) > 1 else "decode"
        out += [(seq, start + i, layer, tuple(ids[i]), ws[i], phase) for i in range(len(ids))]
    return out


def as_tuples(records: list[RoutingRecord]) -> list[tuple]:
    return [(r.seq, r.token, r.layer, r.experts, list(r.weights), r.phase) for r in records]


def assert_same(records: list[RoutingRecord], expected: list[tuple]) -> None:
    got = as_tuples(records)
    assert [g[:4] + g[5:] for g in got] == [e[:4] + e[5:] for e in expected]
    for g, e in zip(got, expected, strict=True):
        assert g[4] == pytest.approx(e[4], abs=1e-6)


def run_session(engine: Engine, n_decode: int) -> list[int]:
    """Prefill PROMPT, then `n_decode` greedy decode steps; the pass starts."""
    with engine.new_session() as session:
        tok = int(session.prefill(PROMPT, last_only=True)[0].argmax())
        for _ in range(n_decode):
            tok = int(session.decode(tok).argmax())
    return [0] + [len(PROMPT) + i for i in range(n_decode)]


def check_prefill_and_decode(engine: Engine, trace: Path, n_decode: int = 3) -> list[RoutingRecord]:
    layers = engine.spec.moe_layers()
    calls = router_spy(engine)
    starts = run_session(engine, n_decode)
    engine.close()
    records = list(read_trace(trace))
    prefill = [r for r in records if r.phase == "prefill"]
    decode = [r for r in records if r.phase == "decode"]
    assert len(prefill) == len(PROMPT) * len(layers) and len(decode) == n_decode * len(layers)
    assert {(r.token, r.layer) for r in prefill} == {(t, x) for t in range(len(PROMPT)) for x in layers}
    decoded = range(len(PROMPT), len(PROMPT) + n_decode)
    assert {(r.token, r.layer) for r in decode} == {(t, x) for t in decoded for x in layers}
    assert {r.seq for r in records} == {0}
    assert_same(records, expected_records(calls, 0, starts))
    return records


def test_prefill_then_decode_records_the_routers_choice(tiny_checkpoint, tmp_path):
    trace = tmp_path / "trace.jsonl"
    engine = Engine.from_pretrained(tiny_checkpoint(ARCH), record_routing=trace)
    assert isinstance(engine.experts, RoutingRecorder) and not engine.experts.graph_safe
    check_prefill_and_decode(engine, trace)
    text = trace.read_text()
    assert text.endswith("\n") and all(line.startswith("{") for line in text.splitlines())


def test_recording_changes_no_result(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint(ARCH)
    plain = Engine.from_pretrained(path).generate(PROMPT, max_new_tokens=6, stop_token_ids=())
    with Engine.from_pretrained(path, record_routing=tmp_path / "t.jsonl") as engine:
        recorded = engine.generate(PROMPT, max_new_tokens=6, stop_token_ids=())
    assert recorded.token_ids == plain.token_ids


def test_sessions_are_numbered_in_the_order_they_first_run(tiny_checkpoint, tmp_path):
    trace = tmp_path / "trace.jsonl"
    with Engine.from_pretrained(tiny_checkpoint(ARCH), record_routing=trace) as engine:
        first, second = engine.new_session(), engine.new_session()
        second.prefill([1, 2, 3])  # runs first: sequence 0
        first.prefill([4, 5])
        second.decode(6)
        twin = second.fork()
        twin.decode(7)  # a fork is a new sequence, continuing at its fork position
    records = list(read_trace(trace))
    assert len(records) == 7 * len(engine.spec.moe_layers())
    got = list(dict.fromkeys((r.seq, r.token, r.phase) for r in records))
    assert got == [
        *[(0, t, "prefill") for t in range(3)],
        *[(1, t, "prefill") for t in range(2)],
        (0, 3, "decode"),
        (2, 4, "decode"),
    ]


def test_tiered_engine_records_the_same_routing(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint(ARCH)
    ftw = tmp_path / "m.ftw"
    convert_checkpoint(folder, ftw, quant="fp32", progress=False)
    tiered_trace, resident_trace = tmp_path / "tiered.jsonl", tmp_path / "resident.jsonl"
    engine = Engine.from_pretrained(
        ftw,
        placement="qstar",
        memory=MemoryBudget(),
        tiering=TieringOptions(prefetch_thread=False),
        record_routing=tiered_trace,
    )
    assert engine.stats()["placement"] == "qstar" and "tiers" in engine.stats()
    tiered = check_prefill_and_decode(engine, tiered_trace)
    resident_engine = Engine.from_pretrained(folder, record_routing=resident_trace)
    resident = check_prefill_and_decode(resident_engine, resident_trace)
    assert [r.experts for r in tiered] == [r.experts for r in resident]


def test_wrapping_the_store_keeps_recording_and_close_closes_it(tiny_checkpoint, tmp_path):
    """`use_expert_provider` with a delegating wrapper (calibration's counter) keeps recording, and
    closing the engine while the wrapper is in use still writes the trace and closes the store."""
    trace = tmp_path / "trace.jsonl"
    engine = Engine.from_pretrained(tiny_checkpoint(ARCH), record_routing=trace)
    recorder = engine.experts
    closed: list[bool] = []

    class Inner(DelegatingStore):
        def close(self) -> None:
            closed.append(True)

    recorder.inner = Inner(recorder.inner)
    counter = RoutingCounter(recorder)
    engine.use_expert_provider(counter)
    with engine.new_session() as session:
        session.prefill([1, 2, 3, 4])
    engine.close()
    assert closed == [True]
    records = list(read_trace(trace))
    assert len(records) == 4 * len(engine.spec.moe_layers())
    assert sum(int(c.sum()) for c in counter.counts.values()) == sum(len(r.experts) for r in records)


def test_recorder_owns_its_store_and_buffers_whole_lines(tmp_path, monkeypatch):
    import freetoken_agents.engine.memory.routing_record as rr

    monkeypatch.setattr(rr, "FLUSH_LINES", 3)
    closed: list[bool] = []

    class Store(ExpertStore):
        def get(self, layer, expert):
            raise KeyError

        def run(self, layer, hidden, expert_ids, weights, spec):
            return hidden

        def close(self) -> None:
            closed.append(True)

    trace = tmp_path / "t.jsonl"
    recorder = RoutingRecorder(Store(), trace)
    recorder.begin_step("a", 5, 2)
    hidden = torch.zeros(2, 4)
    recorder.run(1, hidden, torch.tensor([[3, 1], [0, 2]]), torch.tensor([[0.75, 0.25], [0.5, 0.5]]), None)
    assert trace.read_text() == ""  # buffered
    recorder.run(2, hidden, torch.tensor([[1, 0], [2, 3]]), torch.tensor([[0.6, 0.4], [0.9, 0.1]]), None)
    assert trace.read_text().count("\n") == 4  # flushed: whole lines only
    recorder.begin_step("b", 0, 1)
    recorder.run(1, hidden[:1], torch.tensor([[7, 6]]), torch.tensor([[1.0, 0.0]]), None)
    recorder.close()
    recorder.close()
    assert closed == [True, True]  # closing the inner store again is its own business (idempotent)
    records = list(read_trace(trace))
    assert records[0] == RoutingRecord(0, 5, 1, (3, 1), (0.75, 0.25), "prefill")
    assert records[-1] == RoutingRecord(1, 0, 1, (7, 6), (1.0, 0.0), "decode")
    assert len(records) == 5


def test_generate_command_writes_a_trace(tiny_checkpoint, tmp_path, capsys):
    trace = tmp_path / "gen.jsonl"
    path = tiny_checkpoint(ARCH)
    argv = ["generate", str(path), "--prompt", "def add(a, b):", "--max-new-tokens", "4"]
    assert main([*argv, "--record-routing", str(trace)]) == 0
    capsys.readouterr()
    records = list(read_trace(trace))
    layers = Engine.from_pretrained(path).spec.moe_layers()
    assert {r.seq for r in records} == {0} and {r.layer for r in records} == set(layers)
    decode = [r for r in records if r.phase == "decode"]
    assert len(decode) == 3 * len(layers)  # the 4th token is sampled, never run
    assert min(r.token for r in decode) == max(r.token for r in records if r.phase == "prefill") + 1


def test_the_flag_fills_the_option(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_options(parser.parse_args([])).record_routing is None
    options = engine_options(parser.parse_args(["--record-routing", str(tmp_path / "t.jsonl")]))
    assert options.record_routing == tmp_path / "t.jsonl"


@pytest.mark.parametrize("where", ["missing_folder", "a_folder"])
def test_an_unwritable_path_is_a_one_line_error(tiny_checkpoint, tmp_path, capsys, where):
    trace = tmp_path / "no" / "such" / "t.jsonl" if where == "missing_folder" else tmp_path
    with pytest.raises(EngineError) as caught:
        Engine.from_pretrained(tiny_checkpoint(ARCH), record_routing=trace)
    message = str(caught.value)
    assert "\n" not in message and str(trace) in message
    argv = ["generate", str(tiny_checkpoint(ARCH)), "--prompt", "hi", "--record-routing", str(trace)]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(trace) in err


@pytest.mark.parametrize(
    "command",
    [
        ["chat"],
        ["demo"],
        ["serve"],
        ["generate"],
        ["recipe", "tool_loop"],
        ["recipe", "coding_assistant"],
        ["recipe", "langchain_agent"],
    ],
)
def test_every_command_that_loads_a_model_takes_the_flag(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    assert "--record-routing" in capsys.readouterr().out


def test_the_langchain_model_passes_the_option(tmp_path):
    pytest.importorskip("langchain_core")
    from freetoken_agents.integrations.langchain import ChatFreeToken

    llm = ChatFreeToken(model="m", record_routing=str(tmp_path / "t.jsonl"))
    assert llm.engine_options().record_routing == tmp_path / "t.jsonl"


_FULL_DISK = """
import resource, signal, sys
from freetoken_agents.engine import Engine
from freetoken_agents.engine.memory import routing_record
folder, trace, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
routing_record.FLUSH_LINES = 40  # write often, so some writes succeed before the disk is full
with Engine.from_pretrained(folder) as plain:
    want = plain.generate(list(range(3, 20)), max_new_tokens=24, stop_token_ids=()).token_ids
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # the disk is full past `limit` bytes
with Engine.from_pretrained(folder, record_routing=trace) as engine:
    got = engine.generate(list(range(3, 20)), max_new_tokens=24, stop_token_ids=()).token_ids
assert got == want, (got, want)
print("ok")
"""


def test_a_full_disk_mid_trace_stops_recording_and_keeps_a_valid_trace(tiny_checkpoint, tmp_path):
    """A write that fails partway (the disk fills: here RLIMIT_FSIZE) is cut back to the last whole
    line and ends the recording with one logged error; generation goes on, unchanged. Before, the
    OSError escaped from the MoE layer and killed the generation, and the trace ended mid-line."""
    import os
    import subprocess
    import sys

    trace = tmp_path / "trace.jsonl"
    limit = 6000  # a few flushes fit, then a write is cut short
    run = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tiny_checkpoint(ARCH)), str(trace), str(limit)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]
    assert "recording stopped, the trace ends at its last whole line" in run.stderr
    data = trace.read_bytes()
    assert 0 < len(data) <= limit and data.endswith(b"\n")
    records = list(read_trace(trace))  # every line whole and valid
    assert records and records[0].seq == 0 and records[0].token == 0
