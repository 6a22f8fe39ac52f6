"""A turn's text as it streams, for the turn decoder (`_decode.TurnDecoder`) built on it: the
free-text segments (detokenised incrementally), what is held back before it is delivered (what
may start a call marker or a fence, a reasoning block's end marker, the answer's headers after
it, what may begin a stop string), the reasoning block at the turn's start streamed apart, and
the cuts that put an anchor before the token a call or a fence starts at.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from freetoken_agents.engine import MemoryBudgetError, held_back_for_stops
from freetoken_agents.engine.text.stop_text import first_stop

from ._fences import FenceDetector
from ._turn_output import TurnOutput
from .anchors import AnchorHandle
from .backend import GenerateRequest, GenEvent
from .detokenize import IncrementalDetokenizer
from .grammar_factory import GrammarFactory
from .parsers import ReasoningMarkers, ToolCallParser
from .trace import AnchorKind


class TurnModel(Protocol):
    """What a turn's decoder (`TurnText`, `_decode.TurnDecoder`) needs of a model (FreeTokenModel
    is one): its context (`position`, `token_ids`, `max_context`), the steps that change it,
    anchors, and the chat format's parts. Declared here so neither module imports `model.py`
    (which imports them)."""

    tokenizer: Any
    parser: ToolCallParser
    reasoning: ReasoningMarkers | None
    stop_ids: tuple[int, ...]
    trained_tools: frozenset[str]

    @property
    def position(self) -> int: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def max_context(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    def prefill(self, token_ids: Sequence[int]) -> None: ...
    def decode(self, token_id: int) -> None: ...
    def append_pending(self, token_id: int) -> None: ...
    def truncate(self, position: int) -> None: ...
    def next_logits(self) -> torch.Tensor: ...
    def anchor(self, kind: AnchorKind, label: str | None = None) -> AnchorHandle: ...
    def grammars(self) -> GrammarFactory: ...


class TurnText:
    """The text side of one turn on `model` for `request`: segments, holding back, the reasoning
    block, stop strings and the cuts before an anchor. `output` records each sampled token
    (`_decode` reports it before the model runs it)."""

    def __init__(self, model: TurnModel, request: GenerateRequest, output: TurnOutput) -> None:
        self.m, self.req, self.output = model, request, output
        self.sampled = False  # the token being handled was sampled (not forced by `prefix`)
        self.tools_on = bool(request.tools)
        self.think = thinking(model)
        self.stops = StopStrings(request.stop)
        self._new_segment()
        # harmony: the answer may open with role/channel headers even without an analysis block
        self.strip_leading = bool(model.reasoning is not None and model.reasoning.answer_headers)

    def _new_segment(self) -> None:
        """Start a free-text segment at the current end of the context."""
        self.base = self.m.position  # context length at the segment's start
        self.detok = IncrementalDetokenizer(self.m.tokenizer)
        self.fences = FenceDetector()
        self.searched = 0  # chars of the segment's text already searched for a call marker
        self.emitted = 0  # chars of the segment's text already yielded
        self.strip_leading = False  # the answer after a reasoning block: skip its leading blank lines

    def _decode(self, token: int) -> None:
        """Run a sampled token. At the memory limit it stays in the context as pending (produced,
        not run), as `stream_tokens` leaves it, and the limit ends the turn. A sampled token is
        reported to the turn's output first (logprobs, penalty counts)."""
        if self.sampled:
            self.output.generated(token)
        try:
            self.m.decode(token)
        except MemoryBudgetError:
            self.m.append_pending(token)
            raise

    # ---- a reasoning block at the start of the turn ---------------------------------------------------
    def _reasoning(self, token: int, text: str) -> Iterator[GenEvent]:
        """Handle `token` while the turn may begin, or is inside, a `<think>` block: run it and yield
        "reasoning" deltas (never call or fence detection in there). Returns False when the turn
        turned out not to begin with a block (the token is the answer's: not run yet)."""
        think, markers = self.think, self.m.reasoning
        assert think is not None and markers is not None
        if think.phase == "maybe":
            stripped = text.lstrip()
            if stripped.startswith(markers.start):
                think.phase, think.start = "inside", len(text) - len(stripped) + len(markers.start)
            elif markers.start.startswith(stripped):  # may still become the start marker: hold it
                self._decode(token)
                return True
            else:
                think.phase = "done"
                return False
        self._decode(token)
        end = text.find(markers.end, think.start)
        # trailing blanks wait for what follows: the block's text ends before the end marker's
        upto = len(text[: end if end >= 0 else len(text) - markers.held_back(text)].rstrip())
        yield from self._reasoning_upto(text, upto)
        if end >= 0:
            think.phase = "done"
            rest = text[end + len(markers.end) :].lstrip()
            self._new_segment()  # the answer starts after this token
            self.strip_leading = True
            if rest:  # text the same token carried past the marker
                yield from self._text(rest)
        return True

    def _reasoning_upto(self, text: str, upto: int) -> Iterator[GenEvent]:
        """Yield the block's text up to `upto` not yielded yet (its leading blank lines skipped)."""
        think = self.think
        assert think is not None
        if think.emitted is None:  # nothing yielded yet: start at the first non-blank character
            block = text[think.start : upto]
            if not block.strip():
                return
            think.emitted = think.start + len(block) - len(block.lstrip())
        if upto > think.emitted:
            yield GenEvent("reasoning", text[think.emitted : upto])
            think.emitted = upto

    def _skip_answer_start(self) -> int:
        """While the answer's start is pending (after a reasoning block; harmony: the whole turn),
        skip its blank lines and the markers' answer headers; returns how many characters after
        them to hold back (they may still become a header)."""
        if not self.strip_leading:
            return 0
        text, at = self.detok.text, 0
        headers = self.m.reasoning.answer_headers if self.m.reasoning is not None else ()
        while True:
            at = len(text) - len(text[at:].lstrip())
            header = next((h for h in headers if text.startswith(h, at)), None)
            if header is None:
                break
            at += len(header)
        self.emitted = max(self.emitted, at)
        rest = text[at:]
        if not rest or any(h.startswith(rest) for h in headers):
            return len(rest)
        self.strip_leading = False
        return 0

    def _emit(self) -> Iterator[GenEvent]:
        """Yield the segment's new text, holding back what may start a call marker or a fence."""
        text = self.detok.text
        hold = max(self.fences.held_back, self._skip_answer_start())
        if self.tools_on:
            hold = max(hold, self.m.parser.held_back(text[-len(self.m.parser.start) :]))
        if len(text) - hold > self.emitted:
            delta = text[self.emitted : len(text) - hold]
            self.emitted = len(text) - hold
            yield from self._text(delta)

    def _flush(self, *, end: bool = False) -> Iterator[GenEvent]:
        """Emit the text decoded so far, the incomplete end included. `end`: the turn's free text
        ends here (the turn ends): what stop strings held back is delivered too (`_text`)."""
        self.detok.flush()
        if self.think is not None and self.think.phase == "inside":  # the turn ended in the block
            yield from self._reasoning_upto(self.detok.text, len(self.detok.text))
        else:
            self._skip_answer_start()
            if len(self.detok.text) > self.emitted:
                delta = self.detok.text[self.emitted :]
                self.emitted = len(self.detok.text)
                yield from self._text(delta)
        if end:
            yield from self._text("", end=True)

    def _text(self, delta: str, *, end: bool = False) -> Iterator[GenEvent]:
        """Yield `delta` of the turn's text: while stop strings apply (free text before the first
        call), what may still begin one is held back, and one that appears ends the turn
        (StopStringHit, after the text before it). `end`: the free text ends here (the turn ends,
        or a call begins): deliver what was held back, and stop strings no longer apply."""
        out, hit = self.stops.feed(delta, end=end)
        if out:
            yield GenEvent("text", out)
        if hit:
            raise StopStringHit

    # ---- anchors mid-turn -------------------------------------------------------------------------
    def _cut_to(self, char_index: int, *, keep_text: bool) -> Iterator[GenEvent]:
        """Cut the context back to the last token boundary at or before `char_index` of the
        segment's text (the token just pushed is not in the context yet), so an anchor can go
        before the token that starts there. `keep_text`: the cut tokens will be replayed (same
        tokens, same text), so the text state stays; else it is cut too."""
        pushed = len(self.detok)
        keep = min(self.detok.tokens_within(char_index), pushed - 1)
        self._replay_ids = self.detok.ids[keep:]
        self.m.truncate(self.base + keep)
        if not keep_text:
            self.detok.truncate(keep)
        before = self.detok.text_length_after(keep)
        self._skip_answer_start()
        if before > self.emitted:
            delta = self.detok.text[self.emitted : before]
            self.emitted = before
            yield from self._text(delta)

    def _replay(self) -> None:
        """Re-append the tokens cut for an anchor, the sampled one included (same ids, same KV)."""
        self.m.prefill(self._replay_ids)


class StopStringHit(Exception):
    """A stop string appeared in the turn's free text: the turn ends (finish_reason "stop")."""


class StopStrings:
    """The request's stop strings over the turn's free text as it streams: `feed` returns the text
    to deliver now and whether a stop string appeared (the text before it is delivered, the rest
    dropped). What may still begin one is held back (`engine.stop_text`); once the free text ended
    (`end`) they no longer apply and text passes unchanged."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""  # text held back: it may begin a stop string

    def feed(self, delta: str, *, end: bool = False) -> tuple[str, bool]:
        if not self.stops:
            return delta, False
        text = self.held + delta
        at = first_stop(text, self.stops, searched=len(self.held))
        if at is not None:
            self.stops, self.held = (), ""
            return text[:at], True
        keep = 0 if end else held_back_for_stops(text, self.stops)
        self.held = text[len(text) - keep :]
        if end:
            self.stops = ()
        return text[: len(text) - keep], False


@dataclass
class Think:
    """Where the turn stands with a reasoning block: "maybe" (it may begin with one), "inside",
    "done"; `start`: where the block's text begins in the segment, `emitted`: how far it was
    yielded (None: not at all yet)."""

    phase: str
    start: int = 0
    emitted: int | None = None


def thinking(model: TurnModel) -> Think | None:
    """The turn's reasoning state: None when the template has no reasoning blocks; "inside" when the
    prompt already opened one (the turn starts in it), else "maybe"."""
    markers = model.reasoning
    if markers is None:
        return None
    tail = model.tokenizer.decode(model.token_ids[-8:]) if model.token_ids else ""
    return Think("inside") if markers.opened_by(tail) else Think("maybe")
