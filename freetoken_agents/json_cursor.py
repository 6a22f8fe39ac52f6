"""Where a JSON text being written stands, followed a byte at a time: the open containers (an
object's key being written, whether a key comes next, the keys it holds), the open string or
number, and the tool a call names (its top-level "name"). The constrained decoder's grounding
(`grounding.SpanGrounding`) decides from it what the next token may write."""

from __future__ import annotations

from typing import Any

from .said_keys import ANY_ITEM, Path
from .spans import NUMBER_BYTES


class JsonCursor:
    """Follows a JSON value as it is written: `feed` every accepted piece."""

    def __init__(self) -> None:
        self.tool: bytes | None = None  # the tool's name, once the call writes it
        # [kind, key, expecting a key, the keys written] per open container
        self.stack: list[list[Any]] = []
        self.in_string = self.escaped = self.is_key = False
        self.expect_value = True  # a value may start here (top level, after ":", "[" or an array's ",")
        self.value = b""  # the open string's bytes as written
        self.number: bytes | None = None  # the number being written

    def feed(self, piece: bytes) -> None:
        for c in piece:
            self._feed_byte(c)

    def _feed_byte(self, c: int) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == 0x5C:
                self.escaped = True
            elif c == 0x22:
                self.in_string = False
                if self.is_key and self.stack:
                    self.stack[-1][1], self.stack[-1][2] = self.value, False
                    self.stack[-1][3].add(self.value)
                elif len(self.stack) == 1 and self.stack[0][1] == b"name":  # the call's tool
                    self.tool = self.value
                return
            self.value += bytes((c,))
            return
        if self.number is not None:
            if c in NUMBER_BYTES:
                self.number += bytes((c,))
                return
            self.number = None
        top = self.stack[-1] if self.stack else None
        if c in b" \n\t\r":
            return
        starts_value, self.expect_value = self.expect_value, False
        if c == 0x22:
            self.in_string, self.value = True, b""
            self.is_key = top is not None and top[0] == "object" and top[2]
        elif c in NUMBER_BYTES and starts_value:
            self.number = bytes((c,))
        elif c == 0x7B:  # {
            self.stack.append(["object", b"", True, set()])
        elif c == 0x5B:  # [
            self.stack.append(["array", ANY_ITEM, False, set()])
            self.expect_value = True
        elif c in (0x7D, 0x5D):  # } ]
            if self.stack:
                self.stack.pop()
        elif c == 0x3A:  # :
            self.expect_value = True
        elif c == 0x2C and top is not None:  # ,
            if top[0] == "object":
                top[2] = True
            else:
                self.expect_value = True

    @property
    def _path(self) -> Path:
        return tuple(frame[1] for frame in self.stack)
