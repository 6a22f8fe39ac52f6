"""The routing-trace format (issue 33): JSON lines read back as written; every malformed line is a
one-line RoutingTraceError naming the file and line."""

from __future__ import annotations

import io
import json

import pytest

from freetoken_agents.engine import EngineError
from freetoken_agents.engine.memory.routing_trace import (
    RoutingRecord,
    RoutingTraceError,
    format_record,
    read_trace,
    write_trace,
)

GOOD = {"seq": 0, "token": 3, "layer": 1, "experts": [5, 2], "weights": [0.75, 0.25], "phase": "decode"}


def test_records_round_trip(tmp_path):
    records = [
        RoutingRecord(0, t, layer, (t % 8, (t + 1) % 8), (0.6, 0.4), "prefill" if t < 2 else "decode")
        for t in range(4)
        for layer in (1, 3)
    ]
    buffer = io.StringIO()
    assert write_trace(records, buffer) == len(records)
    path = tmp_path / "trace.jsonl"
    path.write_text(buffer.getvalue() + "\n")  # a trailing blank line is fine
    assert list(read_trace(path)) == records


@pytest.mark.parametrize(
    "weights",
    [
        (0.6, 0.4),
        (0.123456789, 1e-9, 1.0, 0.0),
        (-2.5, 3.0000004, 123456.7891234),
        (float("nan"), float("inf"), -float("inf")),
        (0.30000001192092896, 5e-7),  # float32 values as tolist() gives them
    ],
)
def test_a_line_is_what_json_writes(weights):
    """The recorder's line writer (no json.dumps per line) writes what json.dumps would."""
    experts = tuple(range(len(weights)))
    doc = {"seq": 3, "token": 17, "layer": 5, "experts": list(experts)}
    doc |= {"weights": [round(w, 6) for w in weights], "phase": "decode"}
    line = format_record(3, 17, 5, experts, weights, "decode")
    assert line == json.dumps(doc, separators=(",", ":"))
    assert RoutingRecord(3, 17, 5, experts, weights, "decode").to_json() == line


def test_another_engines_trace_in_this_shape_reads(tmp_path):
    """Keys in any order, integer weights, extra whitespace: what another engine may write."""
    path = tmp_path / "other.jsonl"
    path.write_text(
        '  {"phase": "prefill", "weights": [1], "experts": [7], "layer": 0, "token": 0, "seq": 2}\n'
    )
    assert list(read_trace(path)) == [RoutingRecord(2, 0, 0, (7,), (1.0,), "prefill")]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("not json", "not a JSON object"),
        ([1, 2], "not a JSON object"),
        ({"experts": None}, "experts must be a non-empty list"),
        ({"experts": []}, "experts must be a non-empty list"),
        ({"experts": [1, 1], "weights": [0.5, 0.5]}, "repeat an expert"),
        ({"experts": [1, -2]}, "experts must be a non-empty list"),
        ({"weights": [0.5]}, "weights must be 2 finite numbers"),
        ({"weights": [0.5, float("nan")]}, "weights must be 2 finite numbers"),
        ({"seq": -1}, "seq must be an integer >= 0"),
        ({"token": 1.5}, "token must be an integer >= 0"),
        ({"layer": True}, "layer must be an integer >= 0"),
        ({"phase": "train"}, "phase must be prefill or decode"),
        ("drop:experts", "missing experts"),
    ],
)
def test_a_malformed_line_is_one_line_naming_file_and_line(tmp_path, change, message):
    if change == "not json":
        bad = "{not json"
    elif isinstance(change, list):
        bad = json.dumps(change)
    elif change == "drop:experts":
        bad = json.dumps({k: v for k, v in GOOD.items() if k != "experts"})
    else:
        bad = json.dumps({**GOOD, **change})
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + bad + "\n")
    with pytest.raises(RoutingTraceError) as e:
        list(read_trace(path))
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{path}:2: ") and message in text
    assert isinstance(e.value, EngineError)


def test_a_missing_trace_is_one_line(tmp_path):
    with pytest.raises(RoutingTraceError, match="cannot read routing trace .*missing.jsonl"):
        list(read_trace(tmp_path / "missing.jsonl"))
