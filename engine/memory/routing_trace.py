"""Routing traces: which experts each token chose, layer by layer, as JSON lines.

One line per (token, MoE layer):

    {"seq": 0, "token": 17, "layer": 3, "experts": [5, 1], "weights": [0.62, 0.38], "phase": "decode"}

- `seq`: the sequence (one session's tokens; numbered from 0 in the order sequences start);
- `token`: the token's position in its sequence (from 0);
- `layer`: the model layer index (MoE layers only; dense layers have no line);
- `experts`: the routed experts, in the router's order (top-k); `weights`: their routing weights,
  as many as `experts`;
- `phase`: "prefill" (the token was run in a batch with others) or "decode" (alone).

A trace written by another engine in this shape replays too. `read_trace` checks every line and
raises `RoutingTraceError` naming the file and line for the first malformed one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from ..errors import EngineError

Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, ...] = ("prefill", "decode")


class RoutingTraceError(EngineError):
    """A routing trace that cannot be read, or does not fit the model it is replayed on."""


@dataclass(frozen=True)
class RoutingRecord:
    """One token's routing at one MoE layer (see the module docstring)."""

    seq: int
    token: int
    layer: int
    experts: tuple[int, ...]
    weights: tuple[float, ...]
    phase: Phase

    def to_json(self) -> str:
        return format_record(self.seq, self.token, self.layer, self.experts, self.weights, self.phase)


def format_record(
    seq: int, token: int, layer: int, experts: Iterable[int], weights: Iterable[float], phase: Phase
) -> str:
    """One trace line (without its newline): compact JSON, weights rounded to 6 decimals. Written
    out directly rather than through `json.dumps` (a recorder writes one line per token and layer):
    the same text, as `json.dumps` writes a finite float as its `repr`."""
    ws = [round(w, 6) for w in weights]
    w_text = ",".join(map(repr, ws)) if all(map(math.isfinite, ws)) else ",".join(map(json.dumps, ws))
    return _LINE % (seq, token, layer, ",".join(map(str, experts)), w_text, phase)


_LINE = '{"seq":%d,"token":%d,"layer":%d,"experts":[%s],"weights":[%s],"phase":"%s"}'


MAX_LINE_BYTES = 1 << 20
"""The longest trace line `read_trace` reads (1 MiB; a record of 256 experts is ~5 KB): a file
without newlines is refused at that length rather than read whole into memory."""
MAX_INDEX = 2**63
"""seq, token, layer and expert ids are below this (64-bit integers): a 4,000-digit id is refused
at its line, not printed whole in a later message."""


def parse_record(line: str, where: str) -> RoutingRecord:
    """The record on one JSON line; RoutingTraceError naming `where` (file:line) if malformed."""
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as e:
        raise RoutingTraceError(f"{where}: not a JSON object ({e.msg})") from None
    except RecursionError:  # json's scanner recurses once per nesting level
        raise RoutingTraceError(f"{where}: not a record: JSON nested too deeply") from None
    except ValueError:  # an integer past Python's digit limit for int(str)
        raise RoutingTraceError(f"{where}: not a record: a number too long to read") from None
    if not isinstance(doc, dict):
        raise RoutingTraceError(f"{where}: not a JSON object")
    missing = [k for k in ("seq", "token", "layer", "experts", "weights", "phase") if k not in doc]
    if missing:
        raise RoutingTraceError(f"{where}: missing {', '.join(missing)}")
    for key in ("seq", "token", "layer"):
        if not _is_index(doc[key]):
            raise RoutingTraceError(
                f"{where}: {key} must be an integer >= 0 and below 2**63, got {_short(doc[key])}"
            )
    experts, weights = doc["experts"], doc["weights"]
    if not isinstance(experts, list) or not experts or not all(_is_index(e) for e in experts):
        raise RoutingTraceError(f"{where}: experts must be a non-empty list of integers >= 0 and below 2**63")
    if len(set(experts)) != len(experts):
        raise RoutingTraceError(f"{where}: experts {_short(experts)} repeat an expert")
    if (
        not isinstance(weights, list)
        or len(weights) != len(experts)
        or not all(_is_weight(w) for w in weights)
    ):
        raise RoutingTraceError(f"{where}: weights must be {len(experts)} finite numbers, one per expert")
    if doc["phase"] not in PHASES:
        raise RoutingTraceError(f"{where}: phase must be prefill or decode, got {_short(doc['phase'])}")
    return RoutingRecord(
        doc["seq"], doc["token"], doc["layer"], tuple(experts), tuple(float(w) for w in weights), doc["phase"]
    )


def read_trace(path: str | Path) -> Iterator[RoutingRecord]:
    """The records of the trace at `path`, in file order (blank lines skipped), read one line at a
    time: a trace is never held whole. RoutingTraceError for a missing file or the first malformed
    line (not UTF-8, longer than `MAX_LINE_BYTES`, or not a record), naming file:line."""
    path = Path(path)
    try:
        handle = path.open("rb")
    except OSError as e:
        raise RoutingTraceError(f"cannot read routing trace {path}: {e.strerror or e}") from None
    with handle:
        number = 0
        while True:
            try:
                raw = handle.readline(MAX_LINE_BYTES + 1)
            except OSError as e:
                raise RoutingTraceError(f"cannot read routing trace {path}: {e.strerror or e}") from None
            if not raw:
                return
            number += 1
            where = f"{path}:{number}"
            if len(raw) > MAX_LINE_BYTES:
                raise RoutingTraceError(f"{where}: line longer than {MAX_LINE_BYTES} bytes: not a record")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise RoutingTraceError(
                    f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})"
                ) from None
            if line.strip():
                yield parse_record(line, where)


def write_trace(records: Iterable[RoutingRecord], out: IO[str]) -> int:
    """Write `records` to `out` as JSON lines; returns how many were written."""
    n = 0
    for record in records:
        out.write(record.to_json() + "\n")
        n += 1
    return n


@dataclass(frozen=True)
class Step:
    """One step of the engine: `phase`, how many `tokens` it ran, and per MoE layer expert ->
    tokens routed to it."""

    phase: Phase
    tokens: int
    layers: dict[int, dict[int, int]]


def iter_steps(records: Iterable[RoutingRecord]) -> Iterator[Step]:
    """The records as the engine's steps, one at a time: each decode token alone, a sequence's
    prefill records together (the engine runs each layer once for them; they are consecutive in a
    trace). What a routing profile seeds the tiered memory with, streamed: a long session's trace
    is never held whole (`Engine.from_pretrained(..., routing_profile=PATH)`)."""
    layers: dict[int, dict[int, int]] = {}
    tokens: set[int] = set()
    phase: Phase = "decode"
    key: tuple[Any, ...] | None = None
    for r in records:
        k = (r.seq, "prefill") if r.phase == "prefill" else (r.seq, r.token, "decode")
        if k != key:
            if key is not None:
                yield Step(phase, len(tokens), layers)
            layers, tokens, phase, key = {}, set(), r.phase, k
        routed = layers.setdefault(r.layer, {})
        for e in r.experts:
            routed[e] = routed.get(e, 0) + 1
        tokens.add(r.token)
    if key is not None:
        yield Step(phase, len(tokens), layers)


def group_steps(records: Iterable[RoutingRecord]) -> list[Step]:
    """Every step of `records` (`iter_steps`), as a replay runs them."""
    return list(iter_steps(records))


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_INDEX


def _short(value: Any, limit: int = 60) -> str:
    """`value`'s repr cut to `limit` characters: an error message stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_weight(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
