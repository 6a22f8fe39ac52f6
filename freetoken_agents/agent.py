"""Agent: the tool loop. Model-caused failures roll back to the anchor before the failed call
(earlier calls of the turn and their results stay), append a failure note and regenerate;
transient tool failures retry the tool; both under tenacity.

Concurrency: every run has a context of its own. On a model that can open contexts
(`supports_contexts`: FreeTokenModel) each run opens one and closes it at its end, so runs of one
Agent, of several Agents sharing a model, or over models sharing an engine, proceed side by side;
on one that cannot (ScriptedModel, OpenAICompatibleModel) runs take turns on its one context,
first come first served (`sync_bridge.TurnGate`: waiting threads block, waiting tasks await,
nobody holds a thread while waiting). Model steps run on the one worker thread of the model's
`step_owner` (its engine; `sync_bridge.step_worker`), one short step at a time; tools run on
threads of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import tenacity

from freetoken_agents.engine import MemoryBudgetError

from .anchors import AnchorHandle
from .backend import GenerateRequest, ModelBackend, Usage
from .errors import (
    MaxStepsExceeded,
    MemoryLimitReached,
    ModelCausedError,
    ToolCallMalformed,
    ToolRetryExhausted,
)
from .grounding import conversation_sources
from .parsers import step_call_id
from .relevance import user_sources
from .retry import RetryPolicy
from .sync_bridge import iterate_sync, run_sync, step_worker, turn_gate
from .tool_calls import ResultValidator, ToolCaller
from .tool_choice import ToolChoice, resolve_tool_choice
from .tools import (
    UNSET,
    Timeout,
    Tool,
    check_timeout,
    default_result_chars,
    default_tool_timeout,
    tools_by_name,
)
from .trace import AgentEvent, AgentResult, AnchorRecord, Attempt, RollbackRecord, Step, Trace
from .turn_progress import TurnProgress

__all__ = ["Agent", "AgentEvent", "AgentResult", "ResultValidator", "ToolChoicePolicy"]

logger = logging.getLogger(__name__)

ToolChoicePolicy = Callable[[int], ToolChoice]
"""step number (1-based) -> that model turn's tool_choice."""

_DONE = object()  # end of an astream's event queue


@dataclass
class _Run:
    trace: Trace
    messages: list[dict[str, Any]]
    emit: Callable[[AgentEvent], None]  # hands an event to the astream consumer, at once
    model: Any = None  # the run's context (a ModelBackend), set when the run gets it
    usage0: Usage = field(default_factory=Usage)  # the context's usage when the run got it
    step: int = 0
    turn: TurnProgress = field(default_factory=TurnProgress)  # the current model turn's retries
    last_error: ModelCausedError | None = None


class Agent:
    """`Agent(model, tools=[...], system_prompt=..., retry=RetryPolicy(...), max_steps=...)`.

    `tool_choice` (a ToolChoice) applies to the first model turn (later turns are 'auto', so a run
    can end); a callable `tool_choice(step)` gives every turn's choice instead.
    `result_validator(tool_name, result)` returning False makes the result a model-caused failure.
    `model_settings`: more GenerateRequest fields for every turn (e.g. `logit_bias`, `prefix`,
    `max_call_tokens`); they override `max_new_tokens`, `temperature` and `seed`.
    `validate`: how each rollback checks its anchor, passed to `model.rollback(validate=...)`
    unchanged (the engine's modes, e.g. "signature" or "full"); None: the model's own setting.
    `ground_arguments`: decode every plain string argument as a span of the run's user and tool
    messages, and every number argument as a number written there
    (`GenerateRequest.argument_sources`): a small model then cannot misspell what it copies. None:
    the model's default (`FreeTokenModel.ground_arguments`: on for the embedded model).
    `relevant_calls`: with tool_choice "auto", the model may call only the tools the run's user
    messages are about (a content word in common with a tool's name or description) or that it was
    trained to call; with none, it answers without a call (`GenerateRequest.call_sources`,
    `relevance.py`). None: the model's default (`FreeTokenModel.relevant_calls`: on for the
    embedded model).
    `max_result_chars`: what the model reads of one tool result, at most (longer ones are cut
    with a note, before tokenisation); None: `tools.default_result_chars(model.max_context)`.
    The trace keeps each result up to that cap too. `tool_timeout`: seconds a call of a tool
    without a timeout of its own may run (None: no limit; default `tools.DEFAULT_TOOL_TIMEOUT`).
    Tool names must be unique (DuplicateToolName) and valid (InvalidToolName).

    Concurrent runs (`arun` / `astream` in asyncio, `run` / `stream` in threads, any mix) each
    get exactly their own context and answers (module docstring). `isolate_runs=False` makes
    them take turns on the model's own context even when it could open new ones, leaving the
    last run's context on the model to inspect. Model steps run on a worker thread, so `arun` /
    `astream` leave the event loop free while the model works.
    """

    def __init__(
        self,
        model: ModelBackend,
        tools: Sequence[Tool] = (),
        *,
        system_prompt: str | None = None,
        retry: RetryPolicy | None = None,
        max_steps: int = 8,
        tool_choice: ToolChoice | ToolChoicePolicy = "auto",
        result_validator: ResultValidator | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        seed: int | None = None,
        model_settings: Mapping[str, Any] | None = None,
        validate: str | None = None,
        max_result_chars: int | None = None,
        isolate_runs: bool = True,
        tool_timeout: Timeout = UNSET,
        ground_arguments: bool | None = None,
        relevant_calls: bool | None = None,
    ) -> None:
        self.model, self.system_prompt = model, system_prompt
        self.ground_arguments = model.ground_arguments if ground_arguments is None else ground_arguments
        self.relevant_calls = model.relevant_calls if relevant_calls is None else relevant_calls
        self.validate = validate
        if max_result_chars is not None and max_result_chars < 1:
            raise ValueError(f"max_result_chars must be at least 1, got {max_result_chars}")
        self.max_result_chars = max_result_chars or default_result_chars(model.max_context)
        self.isolate_runs = isolate_runs
        self.tools = tools_by_name(tools)
        self.tool_timeout = check_timeout(tool_timeout, "tool_timeout")
        self.retry = retry or RetryPolicy()
        self.max_steps, self.tool_choice = max_steps, tool_choice
        self.result_validator = result_validator
        self._tools = ToolCaller(self.tools, self.retry, result_validator, self.max_result_chars)
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.model_settings = dict(model_settings or {})
        if {"tools", "force"} & set(self.model_settings):
            raise ValueError("model_settings cannot set 'tools' or 'force': use tools= and tool_choice=")
        self._request(None, "auto")  # fail early on an unknown setting
        if not callable(tool_choice):
            resolve_tool_choice(tool_choice, list(self.tools))  # fail early on an unknown name
        # Every model over one engine (and every context of a model) shares one step worker.
        self._worker = step_worker(model.step_owner)

    # ---- public entry points --------------------------------------------------------------------
    async def astream(self, task: str) -> AsyncIterator[AgentEvent]:
        """Run `task`, yielding AgentEvents as they happen; the last one is `final` with the
        AgentResult. The run is a task of its own feeding a queue; closing the stream early
        cancels it (a model step in flight finishes on the worker thread first)."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        run = _Run(Trace(), [], emit=queue.put_nowait)
        worker = asyncio.create_task(self._run(task, run))
        worker.add_done_callback(lambda _: queue.put_nowait(_DONE))
        try:
            while (event := await queue.get()) is not _DONE:
                yield event
            await worker  # raises the run's error, if it failed
        finally:
            if not worker.done():
                worker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await worker

    async def arun(self, task: str) -> AgentResult:
        """Run `task` to its final answer; raises the run's AgentError if it fails."""
        result = None
        async for event in self.astream(task):
            if event.kind == "final":
                result = event.data
        assert result is not None
        return result

    def run(self, task: str) -> AgentResult:
        """Synchronous `arun`. Inside a running event loop (Jupyter, an async framework) the run
        gets its own loop on a worker thread and this call blocks until it ends; from async code
        `await agent.arun(task)` keeps the caller's loop free instead."""
        return run_sync(self.arun(task))

    def stream(self, task: str) -> Iterator[AgentEvent]:
        """Synchronous `astream`, driven on a private event loop (on a worker thread when the
        calling thread already runs one)."""
        return iterate_sync(self.astream(task))

    # ---- the loop -------------------------------------------------------------------------------
    def _schemas(self) -> list[dict[str, Any]]:
        return [t.json_schema() for t in self.tools.values()]

    def _choice(self, step: int) -> ToolChoice:
        if callable(self.tool_choice):
            choice = self.tool_choice(step)
            resolve_tool_choice(choice, list(self.tools))
            return choice
        return self.tool_choice if step == 1 else "auto"

    def _request(
        self, force: str | None, choice: ToolChoice, messages: Sequence[dict[str, Any]] = ()
    ) -> GenerateRequest:
        settings: dict[str, Any] = dict(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, seed=self.seed
        )
        if self.ground_arguments:
            settings["argument_sources"] = conversation_sources(messages)
        if self.relevant_calls:
            settings["call_sources"] = user_sources(messages)
        return GenerateRequest(
            tools=[] if choice == "none" else self._schemas(),
            force=force,
            **{**settings, **self.model_settings},
        )

    async def _step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one model step on the model's worker thread (off the event loop)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, functools.partial(fn, *args, **kwargs))

    async def _sync(self, run: _Run, *, generation_prompt: bool = True) -> None:
        m, messages = run.model, run.messages
        await self._step(
            lambda: m.sync(m.render(messages, self._schemas(), generation_prompt=generation_prompt))
        )

    @contextlib.asynccontextmanager
    async def _context(self) -> AsyncIterator[ModelBackend]:
        """The run's context: a new one when the model opens them (closed at the end, even when
        the run is cancelled), else the model's own, once the runs before this one are done."""
        m = self.model
        if self.isolate_runs and m.supports_contexts:
            context = await self._step(m.new_context)
            try:
                yield context
            finally:  # submitted, not awaited bare: a cancelled run still closes its context
                await asyncio.shield(asyncio.wrap_future(self._worker.submit(context.close)))
            return
        gate = turn_gate(m)
        await gate.acquire_async()
        try:
            await self._step(m.reset)
            yield m
        finally:
            gate.release()

    async def _run(self, task: str, run: _Run) -> AgentResult:
        async with self._context() as model:
            run.model, run.usage0 = model, model.usage()
            try:
                with default_tool_timeout(self.tool_timeout):  # this run's task only
                    return await self._loop(task, run)
            except MemoryBudgetError as e:  # a prefill (context, note, rebuild) did not fit
                self._totals(run)
                partial = run.trace.steps[-1].text if run.trace.steps else ""
                raise MemoryLimitReached(
                    f"generation was stopped by the memory limit: {e}",
                    partial_output=partial,
                    trace=run.trace,
                ) from e

    async def _loop(self, task: str, run: _Run) -> AgentResult:
        m = run.model
        if self.system_prompt is not None:
            run.messages.append({"role": "system", "content": self.system_prompt})
            await self._sync(run, generation_prompt=False)
            run.emit(self._anchor(run, await self._step(m.anchor, "system_prompt")))
        run.messages.append({"role": "user", "content": task})
        for step in range(1, self.max_steps + 1):
            run.step, run.turn = step, TurnProgress()
            choice = self._choice(step)
            usage0 = m.usage()
            await self._sync(run)
            record = Step(number=step)
            run.trace.steps.append(record)
            calls = await self._turn(run, record, resolve_tool_choice(choice, list(self.tools)), choice)
            usage = m.usage()
            record.tokens_prefilled = usage.prefilled - usage0.prefilled
            record.tokens_decoded = usage.decoded - usage0.decoded
            self._totals(run)
            if calls is None:
                record.final = True
                run.messages.append({"role": "assistant", "content": record.text})
                result = AgentResult(output=record.text, trace=run.trace, messages=run.messages)
                run.emit(AgentEvent("final", step, result))
                return result
            run.messages.extend(record.to_messages())
            await self._sync(run, generation_prompt=False)
            label = record.tool_calls[-1].tool
            run.emit(self._anchor(run, await self._step(m.anchor, "tool_result", label=label)))
        self._totals(run)
        raise MaxStepsExceeded(f"no final answer after {self.max_steps} steps", run.trace)

    async def _turn(self, run: _Run, record: Step, force: str | None, choice: ToolChoice) -> list | None:
        """One model turn under the model-scope retry. Returns the executed calls, or None for a
        final answer."""
        attempts: list[Attempt] = []
        retrying = self.retry.model_retrying()
        try:
            async for attempt in retrying:
                with attempt:
                    number = attempt.retry_state.attempt_number
                    if number > 1:
                        await self._rollback_and_note(run, number - 1)
                    try:
                        return await self._attempt(run, record, force, choice)
                    except ModelCausedError as e:
                        run.last_error = e
                        attempts.append(Attempt.from_error(number, "model", e))
                        run.trace.retries.append(attempts[-1])
                        run.emit(AgentEvent("retry", run.step, attempts[-1]))
                        raise
        except tenacity.RetryError as e:
            raise ToolRetryExhausted(
                "the model's tool call kept failing", attempts
            ) from e.last_attempt.exception()
        return None  # pragma: no cover - tenacity returns or raises

    async def _attempt(self, run: _Run, record: Step, force: str | None, choice: ToolChoice) -> list | None:
        m, turn = run.model, run.turn
        turn.start_attempt()
        head = turn.kept_text  # what the model wrote in this turn before the rollback point
        events = m.generate(self._request(force, choice, run.messages))
        parts: list[str] = []
        written, finish = 0, None
        try:
            while (event := await self._step(next, events, None)) is not None:
                if event.kind == "done":
                    finish = event.finish_reason
                elif event.kind == "text":
                    parts.append(event.text)
                    written += len(event.text)
                    run.emit(AgentEvent("text", run.step, event.text))
                elif event.kind == "anchor" and event.anchor is not None:
                    run.emit(self._anchor(run, event.anchor))
                    if event.anchor.kind == "tool_call":
                        turn.anchors.append((len(head) + written, event.anchor))
        finally:
            await self._step(events.close)
        full = head + "".join(parts)
        turn.full_text = full
        if finish == "memory":
            record.text = full
            self._totals(run)
            raise MemoryLimitReached(
                "generation was stopped by the memory limit (the KV cache is full)",
                partial_output=full,
                trace=run.trace,
            )
        parsed = m.parser.parse(full, self._schemas())
        notes = "".join(turn.all_notes) if self.retry.keep_failure_notes else ""
        record.text = (notes + parsed.content).strip()
        if parsed.partial is not None:
            turn.failed_at = parsed.partial_offset
            raise ToolCallMalformed(f"the tool call was not finished: {parsed.partial[:80]!r}")
        record.tool_calls = list(turn.kept_calls)
        new_calls = parsed.calls[len(turn.kept_calls) :]
        if not record.tool_calls and not new_calls:
            return None
        for call in new_calls:
            turn.failed_at = call.offset
            done = turn.take_redo(call.name, call.arguments)
            if done is None:
                call_id = step_call_id(run.step, len(record.tool_calls))
                done = await self._tools.execute(call, call_id, functools.partial(self._tool_event, run))
                run.emit(AgentEvent("tool_result", run.step, done))
            else:
                logger.debug("%s(%s) already ran in this turn: result reused", done.tool, done.arguments)
            record.tool_calls.append(done)
            turn.done.append((call.offset, done))
        turn.failed_at = None
        return record.tool_calls

    def _tool_event(self, run: _Run, kind: Literal["tool_call", "retry"], data: Any) -> None:
        if kind == "retry":
            run.trace.retries.append(data)
        run.emit(AgentEvent(kind, run.step, data))

    # ---- rollback, anchors, totals --------------------------------------------------------------
    async def _rollback_and_note(self, run: _Run, failed_attempt: int) -> None:
        """Back to the anchor before the call that failed (earlier calls of the turn stay), or to
        the turn's start when the attempt placed none before it; then the failure note."""
        m, error, turn = run.model, run.last_error, run.turn
        assert error is not None
        plan = turn.plan_rollback()
        start = m.position
        if plan.anchor is not None:
            kwargs = {"validate": self.validate} if self.validate is not None else {}
            outcome = await self._step(m.rollback, plan.anchor, **kwargs)
            saved = 0 if outcome.rebuilt else plan.anchor.position
            run.trace.rollbacks.append(
                RollbackRecord(
                    anchor_id=plan.anchor.id,
                    from_position=start,
                    to_position=outcome.to_position,
                    tokens_discarded=start - outcome.to_position,
                    tokens_saved=saved,
                    rebuilt=outcome.rebuilt,
                    reason=f"{type(error).__name__}: {error}",
                )
            )
            run.trace.tokens_saved_by_rollback += saved
            run.emit(AgentEvent("rollback", run.step, run.trace.rollbacks[-1]))
        else:  # no anchor to go back to: regenerate the turn from its start
            await self._sync(run)
        note = self.retry.note(
            attempt=failed_attempt, tool=error.tool, arguments=error.arguments, error=error
        )
        if plan.renote and turn.notes:
            await self._step(m.append_text, "".join(turn.notes))
        turn.rolled_back(plan, note)
        await self._step(m.append_text, note)

    def _anchor(self, run: _Run, handle: AnchorHandle) -> AgentEvent:
        record = AnchorRecord(
            id=handle.id, kind=handle.kind, position=handle.position, label=handle.label, step=run.step
        )
        run.trace.anchors.append(record)
        return AgentEvent("anchor", run.step, record)

    def _totals(self, run: _Run) -> None:
        """The run's token counts: its context's usage since the run got it."""
        usage, u0 = run.model.usage(), run.usage0
        run.trace.tokens_prefilled = usage.prefilled - u0.prefilled
        run.trace.tokens_decoded = usage.decoded - u0.decoded
        run.trace.tokens_reused = usage.reused - u0.reused
