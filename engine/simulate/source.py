"""Routing traces as the simulator reads them: a step at a time, afresh for each pass, never whole.

Each replay, baseline and bound walks a trace once, in order (`TraceSource` gives each its own
walk: a file is re-read line by line), and keeps running totals, not per-step records. What is
kept between walks of one trace: its footprint (`trace_fit.TraceFootprint`) and its `TraceFigures`,
whose `caches.NextUses` is the one part that grows with the trace: Belady's offline optimum (the
"belady" policy and the bound) must know when each routed expert is used next, 4 bytes per routed
expert in replay order (a decode token of Qwen3-30B-A3B, top-8 of 128 in 48 layers: 1.5 KiB; of
Mixtral-8x7B, top-2 in 32 layers: 256 bytes), plus O(layers x experts) besides.
(Until 2026-12 `freetoken simulate` held every record and every step, ~47.5 KB a Qwen3-30B-A3B
token, and each bound a keyed copy of the trace and Belady's heap with an entry per use:
20k tokens took 1.3 GB.)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from ..memory.routing_trace import RoutingRecord, RoutingTraceError, Step, iter_steps, read_trace
from .caches import NextUses
from .trace_fit import TraceFootprint, trace_footprint

RecordSource = Union[str, "os.PathLike[str]", Sequence[RoutingRecord], Callable[[], Iterable[RoutingRecord]]]
"""A trace file's path, records already in memory, or a function giving the records afresh."""


def step_keys(step: Step, layers: Sequence[int]) -> Iterator[list[int]]:
    """`step`'s routed experts at each of `layers` as integer keys (layer position x 2**20 +
    expert), sorted: what the caches of `caches` are fed, in replay order."""
    for pos, layer in enumerate(layers):
        yield [pos << 20 | e for e in sorted(step.layers.get(layer, {}))]


@dataclass(frozen=True)
class TraceFigures:
    """What one walk of a trace's steps over a model's MoE `layers` finds: its steps and decode
    steps and tokens, and the next use of every routed expert (`uses`, keyed as `step_keys`)."""

    steps: int
    decode_steps: int
    decode_tokens: int
    uses: NextUses

    @classmethod
    def of(cls, steps: Iterable[Step], layers: Sequence[int]) -> TraceFigures:
        uses = NextUses()
        n = decode = tokens = 0
        for step in steps:
            n += 1
            if step.phase == "decode":
                decode += 1
                tokens += step.tokens
            for keys in step_keys(step, layers):
                uses.add(keys)
        uses.done()
        return cls(n, decode, tokens, uses)


class TraceSource:
    """A routing trace, walked afresh for each pass: a file (re-read line by line; RoutingTraceError
    if it is not a regular file, or if it changes between passes), records in memory, or a
    function that gives the records anew at each call. Iterating it gives its steps
    (`routing_trace.iter_steps`). A one-shot iterator cannot be walked twice: TypeError."""

    def __init__(self, source: RecordSource) -> None:
        if isinstance(source, Iterator):
            raise TypeError("a routing trace is walked once per pass: give a path, a sequence or a function")
        self._source = source
        self._path = Path(source) if isinstance(source, str | os.PathLike) else None
        self._stamp: tuple[int, int, int] | None = None
        self._footprint: TraceFootprint | None = None
        self._figures: dict[tuple[int, ...], TraceFigures] = {}

    @property
    def path(self) -> Path | None:
        return self._path

    def records(self) -> Iterator[RoutingRecord]:
        """A fresh walk of the records, in file order."""
        if self._path is None:
            source = self._source
            return iter(source() if callable(source) else source)  # type: ignore[arg-type]
        self._check_unchanged(self._path)
        return read_trace(self._path)

    def __iter__(self) -> Iterator[Step]:
        return iter_steps(self.records())

    def footprint(self) -> TraceFootprint:
        """`trace_fit.trace_footprint` of the records (one walk, then kept)."""
        if self._footprint is None:
            self._footprint = trace_footprint(self.records())
        return self._footprint

    def figures(self, layers: Sequence[int]) -> TraceFigures:
        """`TraceFigures` over `layers` (one walk, then kept: a budget sweep walks it once)."""
        key = tuple(layers)
        if key not in self._figures:
            self._figures[key] = TraceFigures.of(self, layers)
        return self._figures[key]

    def _check_unchanged(self, path: Path) -> None:
        try:
            st = path.stat()
        except OSError:
            return  # read_trace names the file and why it cannot be read
        if not path.is_file():  # a FIFO or a device gives its bytes once (or blocks)
            raise RoutingTraceError(f"routing trace {path} is not a regular file: it is read once per pass")
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if self._stamp is None:
            self._stamp = stamp
        elif stamp != self._stamp:
            raise RoutingTraceError(f"routing trace {path} changed while it was simulated")


def trace_source(records: RecordSource | TraceSource) -> TraceSource:
    """`records` as a `TraceSource` (itself if it is one)."""
    return records if isinstance(records, TraceSource) else TraceSource(records)
