"""Watching a sandboxed program: its stdout/stderr under the caps and its message channel.

Channel framing, both directions: a 4-byte big-endian length, then that many bytes of UTF-8 JSON
holding one object. The program's side lives in `_code_harness.py` (stdlib only, it runs there).
Nothing that arrives on the channel is trusted: a message over `message_bytes`, one that is not a
JSON object, or bytes that do not frame end the channel (`SandboxChannel.error` says why).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from typing import Any, Literal

LimitKind = Literal["wall_time", "cpu_time", "memory", "file_size", "output", "processes"]
_HEADER = 4
_AFTER_EXIT_S = 0.2  # how long output is still read once the program itself has exited


class _Monitor:
    """Reads a running program's stdout, stderr and channel until it ends or a limit hits."""

    def __init__(
        self,
        proc: subprocess.Popen,
        wall_time_s: float,
        output_bytes: int,
        message_bytes: int,
        to_program: int | None,
        from_program: int | None,
    ) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self.deadline = time.monotonic() + wall_time_s
        self.output_bytes, self.message_bytes = output_bytes, message_bytes
        self.limit: LimitKind | None = None
        self.out = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        self.inbox = bytearray()
        self.channel_error: str | None = None
        self.to_program, self.from_program = to_program, from_program
        self.sel = selectors.DefaultSelector()
        for fd in self.out:
            self.sel.register(fd, selectors.EVENT_READ)
        if from_program is not None:
            self.sel.register(from_program, selectors.EVENT_READ)
        if to_program is not None:
            os.set_blocking(to_program, False)

    # ---- reading ----------------------------------------------------------------------------------
    def pump(self, timeout: float) -> None:
        """Read whatever is ready (waiting at most `timeout` s); notes a wall-time or output limit."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.limit = self.limit or "wall_time"
            return
        for key, _ in self.sel.select(timeout=min(left, timeout)):
            fd = key.fd
            data = os.read(fd, 65536)
            if not data:
                self.sel.unregister(fd)
                if fd == self.from_program:
                    self.channel_error = self.channel_error or "the program closed its channel"
                continue
            if fd == self.from_program:
                self.inbox += data
                if len(self.inbox) > self.message_bytes + _HEADER:
                    self._close_channel(f"the program sent more than {self.message_bytes} bytes at once")
                continue
            self.out[fd] += data
            if sum(len(b) for b in self.out.values()) > self.output_bytes:
                self.limit = "output"

    def _open(self, fd: int | None) -> bool:
        return fd is not None and fd in self.sel.get_map()

    def take_message(self) -> dict[str, Any] | None:
        """The next complete message in the inbox, or None (see `SandboxChannel.receive`)."""
        while True:
            if len(self.inbox) >= _HEADER:
                size = int.from_bytes(self.inbox[:_HEADER], "big")
                if size > self.message_bytes:
                    self._close_channel(f"the program announced a {size}-byte message")
                    return None
                if len(self.inbox) >= _HEADER + size:
                    data = bytes(self.inbox[_HEADER : _HEADER + size])
                    del self.inbox[: _HEADER + size]
                    return self._parse(data)
            if self.limit is not None or not self._open(self.from_program) or self.channel_error:
                return None
            if self.proc.poll() is not None and not self.sel.select(timeout=0):
                self.channel_error = "the program ended"
                return None
            self.pump(0.25)

    def _parse(self, data: bytes) -> dict[str, Any] | None:
        try:
            message = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            self._close_channel(f"the program sent a malformed message ({type(e).__name__})")
            return None
        if not isinstance(message, dict):
            self._close_channel("the program sent a message that is not a JSON object")
            return None
        return message

    def _close_channel(self, why: str) -> None:
        self.channel_error = why
        if self._open(self.from_program):
            self.sel.unregister(self.from_program)

    # ---- writing ----------------------------------------------------------------------------------
    def send(self, data: bytes) -> bool:
        """Write `data` to the program's channel, reading its output meanwhile; False when the
        program closed its end, ended, or a limit hit first."""
        if self.to_program is None:
            return False
        view = memoryview(data)
        while view:
            if self.limit is not None:
                return False
            try:
                view = view[os.write(self.to_program, view) :]
            except BlockingIOError:
                if self.proc.poll() is not None:
                    return False
                self.pump(0.01)
            except BrokenPipeError:
                return False
        return True

    # ---- ending -----------------------------------------------------------------------------------
    def finish(self) -> tuple[bytes, bytes, LimitKind | None]:
        """Close our end of the channel, then read stdout/stderr (up to the cap) until both close
        and the program exits, or a limit hits. Returns (stdout, stderr, limit)."""
        self._close_to_program()
        out_fds = list(self.out)
        ended: float | None = None
        while self.limit is None and any(self._open(fd) for fd in out_fds):
            if ended is None and self.proc.poll() is not None:
                ended = time.monotonic()
            if ended is not None and time.monotonic() - ended > _AFTER_EXIT_S:
                break  # what still holds the pipes outlived the program: it is killed next, unread
            self.pump(0.05)
        if self.limit is None:
            try:
                self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.limit = "wall_time"
        out, err = (bytes(self.out[fd][: self.output_bytes]) for fd in out_fds)
        return out, err, self.limit

    def _close_to_program(self) -> None:
        if self.to_program is not None:
            os.close(self.to_program)
            self.to_program = None

    def close(self) -> None:
        """Release our file descriptors (the caller kills the program's process group)."""
        self._close_to_program()
        if self.from_program is not None:
            if self._open(self.from_program):
                self.sel.unregister(self.from_program)
            os.close(self.from_program)
            self.from_program = None
        self.sel.close()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()


class SandboxChannel:
    """The trusted side of a sandboxed program's message channel (`run_python(driver=...)`).

    Messages are JSON objects. Everything received comes from untrusted code: validate it."""

    def __init__(self, monitor: _Monitor) -> None:
        self._monitor = monitor

    def send(self, message: dict[str, Any]) -> bool:
        """Send one message; False when the program can no longer receive it (see `error`)."""
        data = json.dumps(message, separators=(",", ":")).encode()
        return self._monitor.send(len(data).to_bytes(_HEADER, "big") + data)

    def receive(self) -> dict[str, Any] | None:
        """The program's next message, waiting for it; None when none will come: the program
        ended or closed its channel, a limit hit, or it broke the framing (`error` says which)."""
        return self._monitor.take_message()

    @property
    def error(self) -> str | None:
        """Why `receive` returned None (None while the channel works)."""
        m = self._monitor
        if m.limit is not None:
            return f"the program hit its {m.limit.replace('_', ' ')} limit"
        return m.channel_error
