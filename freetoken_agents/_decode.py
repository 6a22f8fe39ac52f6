"""One assistant turn on FreeTokenModel: free decoding with anchors placed before tool calls and
fenced code blocks, and tool calls whose arguments decode under the tools' JSON schema."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from freetoken_agents.engine import SamplingParams
from freetoken_agents.engine.generate import Sampler

from .model import GenerateRequest, GenEvent

if TYPE_CHECKING:
    from .model import FreeTokenModel

# A fence line (CommonMark): up to three spaces, then a run of three or more backticks.
_FENCE_LINE = re.compile(r"^ {0,3}(`{3,})", re.M)


def opening_fences(text: str) -> list[int]:
    """Char indices of the first backtick of every fence in `text` that opens a code block.

    A fence opens a block when no block is open; a line-start run of at least as many backticks
    closes it. Inline triple backticks (not at a line start) are code spans, not blocks. Stateless,
    so it can run on the whole text after every streamed token, however the tokens split the fence.
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


_PARTIAL_FENCE = re.compile(r"(?:^|\n) {0,3}(`{1,2})$")


def fence_held_back(text: str) -> int:
    """Length of a line-start run of one or two backticks ending `text` (a fence may be coming:
    hold it back from the stream so the anchor event comes before the fence's text)."""
    m = _PARTIAL_FENCE.search(text)
    return len(m.group(1)) if m else 0


class FenceDetector:
    """Reports each newly opened code fence once while a turn streams."""

    def __init__(self) -> None:
        self.seen = 0  # opening fences already reported

    def feed(self, text: str) -> int | None:
        """`text`: the whole turn so far. The char index of a fence opened since the last call
        that returned one, else None."""
        opens = opening_fences(text)
        if len(opens) > self.seen:
            self.seen += 1
            return opens[self.seen - 1]
        return None


class TurnDecoder:
    """Decodes one turn on `model` for `request`, yielding GenEvents (text deltas, anchors, done)."""

    def __init__(self, model: FreeTokenModel, request: GenerateRequest) -> None:
        self.m, self.req = model, request
        self.sample = Sampler(SamplingParams(temperature=request.temperature, seed=request.seed))
        self.base = model.position  # context length at the start of the turn
        self.ids: list[int] = []  # tokens generated (or forced) in this turn
        self.emitted = 0  # characters of the turn's text already yielded
        self.fences = FenceDetector()
        self._pending_replay: list[int] = []
        self._bias = _bias_tensor(request.logit_bias, model.engine.spec.vocab_size)

    def text(self, ids: list[int] | None = None) -> str:
        return self.m.tokenizer.decode(self.ids if ids is None else ids, skip_special_tokens=False)

    def run(self) -> Iterator[GenEvent]:
        if self.req.force is not None and self.req.tools:
            yield from self._call(self.req.force)
            return
        parser, tools_on = self.m.parser, bool(self.req.tools) and self.req.constrain
        forced = self.m.tokenizer.encode(self.req.prefix, add_special_tokens=False) if self.req.prefix else []
        for _ in range(self.req.max_new_tokens + len(forced)):
            token = forced.pop(0) if forced else self._sample_free()
            if token in self.m.stop_ids:
                self.m.session.append_unprocessed(token)
                yield GenEvent("text", self.text()[self.emitted :])
                yield GenEvent("done", finish_reason="stop")
                return
            text = self.text([*self.ids, token])
            start = parser.call_started(text) if tools_on else None
            if start is not None:
                yield from self._cut_to(start)
                yield from self._call("*")
                return
            opened = self.fences.feed(text)
            if opened is not None:
                yield from self._cut_to(opened)
                yield GenEvent("anchor", anchor=self.m.anchor("code_block"))
                self._replay(token)
                continue
            self.ids.append(token)
            self.m._decode(token)
            hold = max(parser.held_back(text) if tools_on else 0, fence_held_back(text))
            if len(text) - hold > self.emitted:
                yield GenEvent("text", text[self.emitted : len(text) - hold])
                self.emitted = len(text) - hold
        yield GenEvent("text", self.text()[self.emitted :])
        yield GenEvent("done", finish_reason="length")

    def _sample_free(self) -> int:
        logits = self.m.next_logits()
        if self._bias is not None:
            self._bias = self._bias.to(device=logits.device, dtype=logits.dtype)
            logits = logits + self._bias
        return self.sample(logits)

    # ---- anchors mid-turn -------------------------------------------------------------------------
    def _cut_to(self, char_index: int) -> Iterator[GenEvent]:
        """Truncate the turn to the last token boundary at or before `char_index` (the sampled
        token is not in the context yet), so an anchor can go before the token that starts there."""
        keep = len(self.ids)
        while keep > 0 and len(self.text(self.ids[:keep])) > char_index:
            keep -= 1
        self._pending_replay = self.ids[keep:]
        if keep < len(self.ids):
            self.m.session.truncate(self.base + keep)
            self.m._logits = None
            self.ids = self.ids[:keep]
        before = self.text()
        if len(before) > self.emitted:
            yield GenEvent("text", before[self.emitted :])
            self.emitted = len(before)

    def _replay(self, token: int) -> None:
        """Re-append the tokens cut for an anchor, then the sampled token (same ids, same KV)."""
        replay = [*self._pending_replay, token]
        self._pending_replay = []
        self.m._prefill(replay)
        self.ids.extend(replay)

    # ---- tool calls -------------------------------------------------------------------------------
    def _call(self, force: str) -> Iterator[GenEvent]:
        m, parser = self.m, self.m.parser
        tools = self.req.tools
        if force != "*":
            tools = [t for t in tools if t.get("function", t).get("name") == force]
        name = force if force != "*" else None
        if parser.needs_name_in_prefix() and name is None:
            if len(tools) != 1:
                raise NotImplementedError(
                    f"{parser.family} calls with several candidate tools are not constrained yet; name one"
                )
            name = tools[0].get("function", tools[0])["name"]
        yield GenEvent("anchor", anchor=m.anchor("tool_call", label=name))
        self._force(parser.call_prefix(name))
        constraint = m.grammars().json_schema(parser.body_schema(tools)) if self.req.constrain else None
        budget = self.req.max_call_tokens
        while budget > 0:
            if constraint is not None:
                if constraint.complete:
                    break
                forced = constraint.forced_text()
                if forced:
                    constraint.accept_text(forced)
                    self._force(forced)
                    budget -= 1
                    continue
            logits = m.next_logits().clone()
            if constraint is not None:
                constraint.mask_(logits)
            token = self.sample(logits)
            if token in m.stop_ids:
                break
            if constraint is not None:
                constraint.accept(token)
            self.ids.append(token)
            m._decode(token)
            budget -= 1
        finish = "stop"
        if constraint is not None and not constraint.complete:
            finish = "length"  # an unterminated call: the parser reports it as partial
        else:
            self._force(parser.call_suffix())
        if m.stop_ids:
            m.session.append_unprocessed(m.stop_ids[0])
        yield GenEvent("text", self.text()[self.emitted :])
        yield GenEvent("done", finish_reason=finish)

    def _force(self, text: str) -> None:
        if text:
            ids = self.m.tokenizer.encode(text, add_special_tokens=False)
            self.m._prefill(ids)
            self.ids.extend(ids)


def _bias_tensor(bias: dict[int, float], vocab_size: int) -> torch.Tensor | None:
    """logit_bias as a dense [V] tensor (None when empty); ids outside the vocabulary are an error."""
    if not bias:
        return None
    out = torch.zeros(vocab_size)
    for token_id, value in bias.items():
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})")
        out[token_id] = value
    return out
