"""One assistant turn on FreeTokenModel: free decoding with anchors placed before tool calls and
fenced code blocks, a leading reasoning block (`<think>`, harmony's analysis channel) streamed
apart, tool calls whose arguments decode under the tools' JSON schema, and the request's stop
strings (`GenerateRequest.stop`) applied to the free text before the turn's first call. The
turn's text (segments, holding back, the reasoning block, stop strings, cuts before an anchor)
is `_turn_text.TurnText`'s; the turn's loop and its tool calls are here.

Linear in the turn's length: text is detokenised incrementally (`IncrementalDetokenizer`), call
markers are searched only in new text and fences are tracked by a small per-character state
machine (`_fences.FenceDetector`), so each token costs the same at token 2,000 as at token 20.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterator

import torch

from freetoken_agents.engine import MemoryBudgetError
from freetoken_agents.engine.runtime.sampling import Sampler

from ._turn_output import RecordingStepper, TurnOutput
from ._turn_text import StopStringHit, TurnModel, TurnText
from .backend import GenerateRequest, GenEvent
from .constrained import ConstrainedDecode
from .errors import TokenLimitTooSmall
from .json_constraint import JsonConstraint
from .relevance import relevant_tools

logger = logging.getLogger(__name__)


class TurnDecoder(TurnText):
    """Decodes one turn on `model` for `request`, yielding GenEvents (text deltas, anchors, done).

    The turn is a series of segments: free text, a tool call, free text again (with
    tool_choice "auto" the model may call several tools in one turn), ... A forced call is the
    whole turn. Raises TokenLimitTooSmall when a forced call cannot fit `max_call_tokens`.

    When the engine's memory limit stops a model step (MemoryBudgetError: the KV cache is full),
    the turn ends there like `engine.generate.stream_tokens`: every token produced is delivered
    (and kept in the context; the last sampled one pending) and "done" says finish_reason "memory".
    """

    def __init__(self, model: TurnModel, request: GenerateRequest) -> None:
        # repetition_penalty counts the context before the turn (vLLM's prompt) and the turn's tokens
        prompt = model.token_ids if request.repetition_penalty != 1.0 else ()
        self.sample = Sampler(request.sampling(), prompt)
        output = TurnOutput(model, self.sample, request.logprobs)
        self.free_used = 0  # free tokens sampled in the turn
        # Relevant calls (`GenerateRequest.call_sources`): the tools tool_choice "auto" may call.
        self.callable = request.tools
        bias = dict(request.logit_bias)
        if request.call_sources is not None:
            self.callable = relevant_tools(request.tools, request.call_sources, model.trained_tools)
            marker = model.tokenizer.encode(model.parser.start, add_special_tokens=False)
            if request.tools and not self.callable and len(marker) == 1:  # a special token: never
                bias[marker[0]] = float("-inf")
        self._refused: dict[int, set[int]] = {}  # position -> tokens a refused call began with there
        self._bias = _bias_tensor(bias, model.vocab_size)
        super().__init__(model, request, output)

    # ---- the turn -------------------------------------------------------------------------------
    def run(self) -> Generator[GenEvent, None, None]:
        events = self._run()
        return self.output.attach(events) if self.output.records else events

    def _run(self) -> Generator[GenEvent, None, None]:
        try:
            try:
                yield from self._turn()
            except MemoryBudgetError as e:
                logger.warning(
                    "the turn was stopped by the memory limit at %d tokens: %s",
                    self.m.position,
                    e,
                )
                yield from self._flush(end=True)
                yield GenEvent("done", finish_reason="memory")
        except StopStringHit:  # the text before it was delivered; the tokens stay in the context
            yield GenEvent("done", finish_reason="stop")

    def _turn(self) -> Iterator[GenEvent]:
        if self.req.force is not None and self.tools_on:
            finish = yield from self._call(self.req.force, forced=True)
            yield from self._end(finish)
            return
        parser, m = self.m.parser, self.m
        prefix = self.req.prefix
        forced = m.tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
        while True:
            sampled = self.sampled = not forced
            if forced:
                token = forced.pop(0)
            elif self.free_used >= self.req.max_new_tokens or m.position + 2 > m.max_context:
                yield from self._flush(end=True)
                yield from self._end("length", stop_token=False)
                return
            else:
                token = self._sample_free()
                self.free_used += 1
            if token in m.stop_ids:
                m.append_pending(token)
                yield from self._flush(end=True)
                yield GenEvent("done", finish_reason="stop")
                return
            self.detok.push(token)
            text = self.detok.text
            if self.think is not None and self.think.phase != "done":
                if (yield from self._reasoning(token, text)):
                    continue
            if self.tools_on:
                start = parser.call_started(text, self.searched)
                self.searched = len(text)
                if start is not None and sampled and not self.callable:
                    yield from self._refuse_call(start)
                    continue
                if start is not None and self.req.constrain:
                    yield from self._cut_to(start, keep_text=False)
                    finish = yield from self._call("*", forced=False)
                    if finish != "stop":
                        yield from self._end(finish)
                        return
                    self._new_segment()  # the model may write more text or another call
                    continue
                if start is not None:  # unconstrained: anchor before the call, decode on freely
                    yield from self._cut_to(start, keep_text=True)
                    yield from self._text("", end=True)  # the call's text is not free text
                    yield GenEvent("anchor", anchor=m.anchor("tool_call"))
                    self._replay()
                    continue
            opened = self.fences.feed(text[self.fences.pos :])
            if opened:
                yield from self._cut_to(opened[0], keep_text=True)
                yield GenEvent("anchor", anchor=m.anchor("code_block"))
                self._replay()
                continue
            self._decode(token)
            yield from self._emit()

    def _sample_free(self) -> int:
        logits = self.m.next_logits()
        if self._bias is not None:
            self._bias = self._bias.to(device=logits.device, dtype=logits.dtype)
            logits = logits + self._bias
        refused = self._refused.get(self.m.position)
        if refused:
            logits = logits.clone()  # the model's logits are its own (cached for the context)
            logits[sorted(refused)] = float("-inf")
        return self.sample(logits)

    def _refuse_call(self, start: int) -> Iterator[GenEvent]:
        """Relevant calls, no offered tool relevant: the call the model began at `start` of the
        segment's text is taken back (the context and the text are cut to before its marker) and
        the token that began it is not sampled at that position again. (A marker that is one
        special token is never sampled at all: `__init__` bans it.)"""
        yield from self._cut_to(start, keep_text=False)
        self.output.taken_back(self._replay_ids[:-1])  # the last one was never run
        self._refused.setdefault(self.m.position, set()).add(self._replay_ids[0])
        self.searched = len(self.detok.text)
        self.fences.pos = min(self.fences.pos, self.searched)  # a marker holds no backticks

    def _end(self, finish: str, *, stop_token: bool = True) -> Iterator[GenEvent]:
        if stop_token and self.m.stop_ids:
            self.m.append_pending(self.m.stop_ids[0])
        yield GenEvent("done", finish_reason=finish)

    # ---- tool calls -------------------------------------------------------------------------------
    def _call(self, force: str, *, forced: bool) -> Iterator[GenEvent]:
        """One tool call: anchor, marker, arguments under the schema (in the parser's body format),
        end marker. Returns the finish reason: "stop" when the call is complete, "length" when its
        budget ran out."""
        yield from self._text("", end=True)  # the call's text is not free text
        m, parser = self.m, self.m.parser
        # A call the model opened chooses among the relevant tools (`callable`; all of them when
        # a prefix opened it with none relevant).
        tools = self.req.tools if forced else (self.callable or self.req.tools)
        if force != "*":
            tools = [t for t in tools if t.get("function", t).get("name") == force]
        name = force if force != "*" else None
        chosen: list[int] | None = None  # prefix tokens already in the context (a name was chosen)
        if parser.needs_name_in_prefix() and name is None:
            if len(tools) == 1:
                name = _tool_name(tools[0])
            else:  # the model picks the tool: its marker and name, decoded among the candidates only
                yield GenEvent("anchor", anchor=m.anchor("tool_call"))
                name, chosen = self._choose_name([_tool_name(t) for t in tools])
                tools = [t for t in tools if _tool_name(t) == name]
        prefix, suffix = parser.call_prefix(name), parser.call_suffix()
        prefix_ids = chosen if chosen is not None else m.tokenizer.encode(prefix, add_special_tokens=False)
        suffix_ids = m.tokenizer.encode(suffix, add_special_tokens=False) if suffix else []
        limit = self.req.max_call_tokens
        ahead = len(prefix_ids) if chosen is None else 0  # a chosen prefix is in the context already
        room = m.max_context - m.position - ahead - len(suffix_ids) - 1
        decode = None
        if self.req.constrain:
            schema = parser.body_schema(tools)
            constraint = _body_constraint(m, parser.body_format, schema, self.req.argument_sources, tools)
            stepper = RecordingStepper(m, self.output) if self.output.records else m
            decode = ConstrainedDecode(
                stepper, constraint, budget=limit, room=room, sampler=self.sample, tokenizer=m.tokenizer
            )
            if forced and decode.min_tokens > limit:
                raise TokenLimitTooSmall(
                    f"max_call_tokens={limit} is too small for a call to {force!r}: its shortest "
                    f"arguments take {decode.min_tokens} sampled tokens",
                    limit="max_call_tokens",
                    value=limit,
                    needed=decode.min_tokens,
                )
        if chosen is None:
            yield GenEvent("anchor", anchor=m.anchor("tool_call", label=name))
            m.prefill(prefix_ids)
        yield GenEvent("text", prefix)
        if decode is None:  # unconstrained: the model writes the arguments and the end marker
            return (yield from self._free_body(min(limit, room)))
        for delta in decode:
            if delta:
                yield GenEvent("text", delta)
        if decode.finish_reason != "stop":
            return "length"  # an unterminated call: the parser reports it as partial
        m.prefill(suffix_ids)
        if suffix:
            yield GenEvent("text", suffix)
        return "stop"

    def _choose_name(self, names: list[str]) -> tuple[str, list[int]]:
        """Decode a call's prefix when it holds the tool's name (harmony, DeepSeek) and several tools
        may be called: tokens all candidates share are forced, and where they differ the model
        samples among the candidates' next tokens only. Returns the name and the prefix tokens
        (now in the context)."""
        m = self.m
        self.sampled = True
        candidates = {n: m.tokenizer.encode(m.parser.call_prefix(n), add_special_tokens=False) for n in names}
        taken: list[int] = []
        while True:
            alive = {n: ids for n, ids in candidates.items() if ids[: len(taken)] == taken}
            done = [n for n, ids in alive.items() if len(ids) == len(taken)]
            if done:
                return done[0], taken
            following = {ids[len(taken)] for ids in alive.values()}
            if len(following) == 1:
                token = following.pop()
                m.prefill([token])
            else:
                logits = m.next_logits()
                if self._bias is not None:
                    logits = logits + self._bias.to(device=logits.device, dtype=logits.dtype)
                allowed = torch.full_like(logits, float("-inf"))
                allowed[sorted(following)] = 0.0
                token = self.sample(logits + allowed)
                self._decode(token)
            taken.append(token)

    def _free_body(self, limit: int) -> Iterator[GenEvent]:
        """An unconstrained forced call's body: free tokens up to the stop token (not appended:
        the turn's end adds it) or `limit`. Returns the finish reason."""
        self._new_segment()
        self.sampled = True
        for _ in range(max(0, limit)):
            token = self._sample_free()
            if token in self.m.stop_ids:
                yield from self._flush()
                return "stop"
            self.detok.push(token)
            self._decode(token)
            yield from self._emit()
        yield from self._flush()
        return "length"


def _body_constraint(
    model: TurnModel, body_format: str, schema: dict, sources: list[str] | None, tools: list[dict]
) -> JsonConstraint:
    """The grammar of a call's body in the parser's `body_format` (see ToolCallParser); a JSON
    body's plain string arguments grounded in `sources` when given (`tools`: the tools called)."""
    if body_format == "xml_parameters":
        return model.grammars().xml_parameters(schema)
    return model.grammars().json_schema(schema, sources, tools)


def _tool_name(tool: dict) -> str:
    return tool.get("function", tool)["name"]


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
