"""Fenced code blocks in streamed model text: where a block opens (the Agent anchors before it)
and how much of a text's end may still become a fence. A small per-character state machine
(`FenceDetector`), so each new character costs the same at character 20,000 as at 20.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A fence line (CommonMark): up to three spaces, then a run of three or more backticks.
_FENCE_LINE = re.compile(r"^ {0,3}(`{3,})", re.M)


def opening_fences(text: str) -> list[int]:
    """Char indices of the first backtick of every fence in `text` that opens a code block.

    A fence opens a block when no block is open; a line-start run of at least as many backticks
    closes it. Inline triple backticks (not at a line start) are code spans, not blocks. Stateless
    (a whole text at once); a stream uses `FenceDetector`, which gives the same answer.
    """
    opens: list[int] = []
    open_len = 0
    for m in _FENCE_LINE.finditer(text):
        run = len(m.group(1))
        if open_len == 0:
            opens.append(m.start(1))
            open_len = run
        elif run >= open_len and not text[m.end(1) :].split("\n", 1)[0].strip():
            open_len = 0  # a closing fence: backticks only on its line
    return opens


def fence_held_back(text: str) -> int:
    """Length of a line-start run of one or two backticks ending `text` (a fence may be coming:
    hold it back from the stream so the anchor event comes before the fence's text). Looks at the
    last few characters only."""
    run = len(text) - len(text.rstrip("`"))
    if run not in (1, 2):
        return 0
    head = text[: len(text) - run]
    indent = len(head) - len(head.rstrip(" "))
    if indent > 3:
        return 0
    before = head[: len(head) - indent]
    return run if not before or before.endswith("\n") else 0


# Line phases of the fence detector.
_INDENT, _RUN, _TAIL, _REST = range(4)


@dataclass
class FenceDetector:
    """Reports each code fence that opens while a turn streams, one character at a time.

    `feed(new_text)` takes the text added since the last call and returns the absolute char
    indices of fences it opened (an opening is reported as soon as its third backtick arrives).
    A closing fence (a run at least as long as the opening one, nothing but spaces after it on
    its line) is decided at its line's end. O(1) per character.
    """

    pos: int = 0  # characters consumed
    open_len: int = 0  # backticks of the open block's fence (0: no block open)
    phase: int = _INDENT
    indent: int = 0
    run: int = 0
    run_start: int = 0
    opened_here: bool = False  # this line's run opened the current block

    def feed(self, new_text: str) -> list[int]:
        opens: list[int] = []
        for c in new_text:
            if c == "\n":
                if self._closes() or self.phase == _TAIL:
                    self.open_len = 0
                self.phase, self.indent, self.run, self.opened_here = _INDENT, 0, 0, False
            elif self.phase == _INDENT:
                if c == "`":
                    self.phase, self.run, self.run_start = _RUN, 1, self.pos
                elif c == " " and self.indent < 3:
                    self.indent += 1
                else:
                    self.phase = _REST
            elif self.phase == _RUN:
                if c == "`":
                    self.run += 1
                    if self.run == 3 and self.open_len == 0:
                        opens.append(self.run_start)
                        self.opened_here = True
                    if self.opened_here:
                        self.open_len = self.run
                else:
                    self.phase = _TAIL if self._closes() and c.isspace() else _REST
            elif self.phase == _TAIL and not c.isspace():
                self.phase = _REST
            self.pos += 1
        return opens

    def _closes(self) -> bool:
        """This line's run (so far) would close the open block."""
        return self.phase == _RUN and not self.opened_here and 0 < self.open_len <= self.run

    @property
    def held_back(self) -> int:
        """A line-start run of one or two backticks at the end: a fence may be coming."""
        return self.run if self.phase == _RUN and self.run < 3 else 0
