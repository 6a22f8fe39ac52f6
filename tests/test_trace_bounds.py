"""The trace stays bounded and JSON-safe: a tool call's record keeps a result up to the cap the model
read it under (with the note that it was cut), and `to_json()` never fails on a result."""

from __future__ import annotations

import json
import math

from freetoken_agents import Agent, Trace, tool
from freetoken_agents.testing import ScriptedModel, ToolCall
from freetoken_agents.trace import ToolCallRecord

CAP = 2000


def run_with(result_of, calls: int = 1):
    @tool
    def produce(i: int) -> object:
        "Returns something."
        return result_of(i)

    script = [ToolCall("produce", {"i": i}) for i in range(calls)] + ["done"]
    return Agent(ScriptedModel(script), [produce], max_result_chars=CAP, max_steps=calls + 1).run("go")


def test_twenty_large_results_are_kept_only_up_to_the_cap() -> None:
    """The bug: the trace kept every raw result (20 x 10 MB: +316 MiB, 210 MB of trace JSON)."""
    result = run_with(lambda i: chr(ord("a") + i) * 1_000_000, calls=20)
    records = result.trace.tool_calls
    assert len(records) == 20
    for i, record in enumerate(records):
        assert record.result == record.content  # the capped text the model read, nothing more
        assert record.result.startswith(chr(ord("a") + i) * CAP)
        assert "[truncated: the result had 1,000,000 characters" in record.result
        assert len(record.result) <= CAP + 200
    assert len(result.trace.to_json()) < 20 * 2 * (CAP + 200) + 50_000  # not 20 MB


def test_a_large_structure_is_kept_as_its_capped_json_text() -> None:
    result = run_with(lambda i: {"rows": list(range(1_000_000))})
    (record,) = result.trace.tool_calls
    assert isinstance(record.result, str) and record.result.startswith('{"rows": [0, 1, 2')
    assert "more than 2,000 characters" in record.result and len(record.result) <= CAP + 200


def test_small_plain_results_are_kept_as_they_are() -> None:
    value = {"city": "Paris", "temperature": 21.5, "tags": ["sunny", None, True], "é": "ü"}
    result = run_with(lambda i: value)
    (record,) = result.trace.tool_calls
    assert record.result == value
    again = Trace.model_validate_json(result.trace.to_json())
    assert again.tool_calls[0].result == value


def test_non_json_results_never_break_to_json() -> None:
    """The bug: `trace.to_json()` raised on a set, an object, NaN."""

    class Opaque:
        def __repr__(self) -> str:
            return "<Opaque thing>"

    results = [{3, 1, 2}, Opaque(), {"x": math.nan}, (1, 2)]
    result = run_with(lambda i: results[i], calls=len(results))
    text = result.trace.to_json()  # must not raise
    stored = [c["result"] for s in json.loads(text)["steps"] for c in s["tool_calls"]]
    assert stored[0] == result.trace.tool_calls[0].content and "1" in stored[0]
    assert "<Opaque thing>" in stored[1]
    assert stored[2] == result.trace.tool_calls[2].content  # NaN is not JSON: stored as text
    assert stored[3] == [1, 2]


def test_a_record_made_by_hand_is_json_safe_too() -> None:
    record = ToolCallRecord(id="c", tool="t", arguments={}, result={1, 2})
    data = json.loads(record.model_dump_json())
    assert "{1, 2}" in data["result"]  # as the model would read it
    huge = ToolCallRecord(id="c", tool="t", arguments={}, result=[object()] * 100_000)
    assert len(json.loads(huge.model_dump_json())["result"]) < 17_000  # capped at DEFAULT_RESULT_CHARS
