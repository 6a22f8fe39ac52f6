"""Recording routing traces (`Engine.from_pretrained(..., record_routing=PATH)`, `--record-routing`).

`RoutingRecorder` is an `ExpertStore` wrapper: every MoE layer's `run(layer, hidden, expert_ids,
weights, spec)` passes through it, and it writes one `routing_trace.RoutingRecord` per row before
delegating. A row's sequence and position come from the session that runs the forward pass: the
engine hands `RoutingRecorder.begin_step` to its sessions as `SessionHost.on_forward`, called with
(session id, first position, token count) before each pass. Sequences are numbered from 0 in the
order their sessions first run a pass (a fork is a new sequence, continuing at its fork position).

Lines are buffered in memory and written in whole lines (flushed every `FLUSH_LINES` lines, on
`close`, and at interpreter exit for an engine never closed). A write that fails (a full disk) is
cut back to the last whole line and ends the recording, logged once; the engine goes on. The
recorder owns the store it wraps: `close` flushes the trace, then closes the inner store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from pathlib import Path
from typing import BinaryIO

import torch

from ..errors import EngineError
from ..model.experts import DelegatingStore, ExpertStore
from ..spec import MoESpec
from .routing_trace import format_record

logger = logging.getLogger(__name__)

FLUSH_LINES = 4096
"""Buffered lines that trigger a write (each write ends on a line boundary)."""


def check_trace_path(path: str | Path) -> Path:
    """`path` (with ~ expanded), after checking a trace can be created there: its folder exists
    and it is not a folder itself (EngineError, one line naming the path)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise EngineError(f"cannot write routing trace {path}: it is a folder")
    if not path.parent.is_dir():
        raise EngineError(f"cannot write routing trace {path}: folder {path.parent} does not exist")
    return path


def _open_trace(path: Path) -> BinaryIO:
    try:
        return path.open("wb", buffering=0)
    except OSError as e:
        raise EngineError(f"cannot write routing trace {path}: {e.strerror or e}") from None


def _write_lines(handle: BinaryIO, lines: list[str]) -> None:
    """Write the buffered `lines` (each ending in a newline) and empty the buffer. A write that
    fails (a full disk, a lost mount) is cut back to the last whole line and ends the recording,
    logged once: the trace stays a valid prefix of the run, and the engine goes on."""
    if lines and not handle.closed:
        data = "".join(lines).encode()
        good = handle.tell()
        try:
            view = memoryview(data)
            while view:
                view = view[handle.write(view) or 0 :]
        except OSError as e:
            logger.error(
                "routing trace %s: cannot write (%s): recording stopped, the trace ends at its last "
                "whole line",
                handle.name,
                e.strerror or e,
            )
            with contextlib.suppress(OSError):
                os.ftruncate(handle.fileno(), good)
            handle.close()
    lines.clear()


def _finish(handle: BinaryIO, lines: list[str]) -> None:
    """Write what is buffered and close the file (the recorder's `close`, or interpreter exit)."""
    try:
        _write_lines(handle, lines)
    finally:
        handle.close()


class RoutingRecorder(DelegatingStore):
    """Writes the routing of every token the engine runs to a JSON-lines trace at `path`
    (`routing_trace`), delegating the computation to `inner`, which it owns (see the module
    docstring). Not `graph_safe`: a CUDA-graph replay would skip `run`, so decode runs eagerly."""

    def __init__(self, inner: ExpertStore, path: str | Path) -> None:
        super().__init__(inner)
        self.path = check_trace_path(path)
        self._lines: list[str] = []
        handle = _open_trace(self.path)
        self._finalizer = weakref.finalize(self, _finish, handle, self._lines)
        self._handle = handle
        self._seqs: dict[str, int] = {}  # session id -> sequence number
        self._seq, self._start, self._count = -1, 0, 0
        self._warned = False

    @property
    def graph_safe(self) -> bool:  # type: ignore[override]
        return False

    def begin_step(self, session_id: str, start: int, count: int) -> None:
        """A session is about to run `count` tokens from position `start` (`SessionHost.on_forward`)."""
        seq = self._seqs.get(session_id)
        if seq is None:
            seq = self._seqs[session_id] = len(self._seqs)
        self._seq, self._start, self._count = seq, start, count

    def run(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, spec: MoESpec
    ) -> torch.Tensor:
        rows = expert_ids.shape[0]
        if self._seq < 0 or rows != self._count:
            if not self._warned:  # a forward pass no session announced: nothing to attribute it to
                logger.warning("routing trace %s: a pass outside a session step is not recorded", self.path)
                self._warned = True
        elif not self._finalizer.alive or self._handle.closed:
            pass  # closed (the engine must not be used any more), or a write failed: nothing more
        else:
            phase = "prefill" if rows > 1 else "decode"
            ids, ws = expert_ids.tolist(), weights.float().tolist()
            seq, start = self._seq, self._start
            self._lines.extend(
                format_record(seq, start + i, layer, ids[i], ws[i], phase) + "\n" for i in range(rows)
            )
            if len(self._lines) >= FLUSH_LINES:
                _write_lines(self._handle, self._lines)
        return self.inner.run(layer, hidden, expert_ids, weights, spec)

    def flush(self) -> None:
        """Write the buffered lines now."""
        if self._finalizer.alive:
            _write_lines(self._handle, self._lines)

    def close(self) -> None:
        """Write the buffered lines, close the trace, then close the inner store. Idempotent."""
        try:
            self._finalizer()
        finally:
            self.inner.close()
