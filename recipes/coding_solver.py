"""The coding assistant's solver: the model writes a function in a fenced code block, `solve` runs
it with its tests in a sandbox and, when they fail, rolls the model back to the anchor placed
before the code fence, appends the error as a note and lets the model write the code again. The
retries run under a tenacity policy; the first attempt is greedy, later ones are sampled
(seeded), so a retry can differ from what failed.

    model = FreeTokenModel.from_pretrained(default_model())
    result = solve(model, "Write a Python function `add_one(x)` that returns x plus 1.",
                   ["assert add_one(1) == 2"])
    result.passed, result.attempts[-1].code, result.tokens_saved

The recipe's command line is `coding_assistant.py`; the conversation it holds, `_coding_format.py`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import tenacity
from pydantic import BaseModel, Field, computed_field

from freetoken_agents import FreeTokenModel, GenerateRequest, ModelCausedError
from freetoken_agents._fences import opening_fences
from freetoken_agents.anchors import AnchorHandle
from freetoken_agents.trace import AnchorRecord, RollbackRecord

from ._code_judge import Judge
from ._coding_format import CODING_SYSTEM_PROMPT, block_closed, code_failure_note, extract_code
from .sandbox import Isolation, SandboxLimits, SandboxResult, run_python

logger = logging.getLogger(__name__)

_HARNESS = Path(__file__).with_name("_code_harness.py")


class CodeFailed(ModelCausedError):
    """Raised inside `solve` when an attempt's code fails its tests or the answer has no code
    block. The tenacity policy retries it (rollback to the code-block anchor, failure note,
    regeneration) until `attempts` run out; `solve` then returns a result with passed=False."""


class CodeAttempt(BaseModel):
    """One generation of the answer and its test run."""

    number: int
    text: str = Field(description="what was generated in this attempt (after any rollback)")
    code: str | None = Field(description="the first fenced code block; None when there is none")
    passed: bool
    error: str | None = Field(default=None, description="one-line failure, as the model is told it")
    temperature: float
    seed: int | None
    tokens_decoded: int = Field(description="tokens run one at a time: sampled ones and any forced prefix")
    sandbox: SandboxResult | None = None


class CodingResult(BaseModel):
    """What `solve` did: every attempt, the anchors placed and the rollbacks between attempts."""

    prompt: str
    tests: list[str]
    passed: bool
    attempts: list[CodeAttempt]
    anchors: list[AnchorRecord]
    rollbacks: list[RollbackRecord]
    answer: str = Field(description="the assistant turn the context ends with: lead-in, notes, code")
    tokens_prefilled: int
    tokens_decoded: int
    seconds: float

    @computed_field  # type: ignore[prop-decorator]
    @property
    def first_try_passed(self) -> bool:
        return bool(self.attempts) and self.attempts[0].passed

    @computed_field  # type: ignore[prop-decorator]
    @property
    def tokens_saved(self) -> int:
        """Prefix tokens the rollbacks kept instead of recomputing."""
        return sum(r.tokens_saved for r in self.rollbacks)

    @property
    def code(self) -> str | None:
        return self.attempts[-1].code if self.attempts else None

    def summary(self) -> str:
        n = len(self.attempts)
        outcome = f"passed on attempt {n}" if self.passed else f"failed all {n} attempts"
        return (
            f"{outcome}; {len(self.anchors)} anchors, {len(self.rollbacks)} rollbacks, "
            f"{self.tokens_saved} tokens kept by rollback, {self.tokens_decoded} tokens decoded, "
            f"{self.seconds:.1f} s"
        )


@dataclass(frozen=True)
class CodingEvent:
    """Progress of `solve`. kind: start (data: {temperature, seed}), text (a delta), anchor
    (AnchorRecord), attempt (CodeAttempt), rollback (RollbackRecord), note (the text appended)."""

    kind: Literal["start", "text", "anchor", "attempt", "rollback", "note"]
    attempt: int
    data: Any = None


def check_code(
    code: str, tests: Sequence[str], *, limits: SandboxLimits | None = None, isolation: Isolation = "auto"
) -> SandboxResult:
    """Run `code` in the sandbox and check each test (an assert statement) against it. passed: all
    held. The verdict is this process's (`_code_judge.py`): the tests are evaluated here and only
    calls of the code's functions run in the sandbox, so code that exits early, patches
    sys.exit/atexit/builtins or prints anything fails. ValueError for a test that is not Python."""
    judge = Judge(list(tests))
    result = run_python(
        _HARNESS.read_text(), files={"solution.py": code}, limits=limits, isolation=isolation, driver=judge
    )
    return judge.result(result)


def solve(
    model: FreeTokenModel,
    prompt: str,
    tests: Sequence[str],
    *,
    attempts: int = 4,
    system_prompt: str = CODING_SYSTEM_PROMPT,
    max_new_tokens: int = 160,
    temperature: float = 0.7,
    seed: int = 0,
    prefix: str = "",
    limits: SandboxLimits | None = None,
    isolation: Isolation = "auto",
    on_event: Callable[[CodingEvent], None] | None = None,
) -> CodingResult:
    """Ask `model` for code that passes `tests`, retrying with rollback up to `attempts` times.

    Attempt 1 is greedy; attempt k > 1 samples at `temperature` with seed `seed + k - 1`. A turn
    stops once its first code block closes. `prefix` is text the answer is made to start with
    (e.g. "Sure:\\n```python\\n"); after a rollback to the code-block anchor its part from the
    fence on is forced again. When a failed answer has no code block, the rollback goes to an
    earlier attempt's code-block anchor (or to the start of the answer when there is none) and
    the notes the context lost are appended again with the new one."""
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    settings = _Settings(
        attempts, system_prompt, max_new_tokens, temperature, seed, limits, isolation, on_event or _ignore
    )
    return _Solver(model, prompt, list(tests), prefix, settings).run()


def _ignore(event: CodingEvent) -> None:
    """The default `on_event`."""


@dataclass(frozen=True)
class _Settings:
    attempts: int
    system_prompt: str
    max_new_tokens: int
    temperature: float
    seed: int
    limits: SandboxLimits | None
    isolation: Isolation
    emit: Callable[[CodingEvent], None]


class _Solver:
    def __init__(
        self, model: FreeTokenModel, prompt: str, tests: list[str], prefix: str, s: _Settings
    ) -> None:
        self.m, self.prompt, self.tests, self.s, self.emit = model, prompt, tests, s, s.emit
        fences = opening_fences(prefix)
        self.lead, self.fence_part = (prefix[: fences[0]], prefix[fences[0] :]) if fences else (prefix, "")
        self.prefix = prefix  # what the next attempt is made to start with
        self.anchors: list[AnchorRecord] = []
        self.rollbacks: list[RollbackRecord] = []
        self.results: list[CodeAttempt] = []
        self.notes: list[str] = []
        self.answer_anchor: AnchorHandle | None = None
        self.last_fence: AnchorHandle | None = None  # the latest attempt's code-block anchor
        self.notes_before_fence = 0  # failure notes in the context before `last_fence`

    def run(self) -> CodingResult:
        t0, m = time.perf_counter(), self.m
        m.reset()
        usage0 = m.usage()
        messages = [{"role": "system", "content": self.s.system_prompt}]
        m.sync(m.render(messages, None, generation_prompt=False))
        self._record(m.anchor("system_prompt"), 1)
        messages.append({"role": "user", "content": self.prompt})
        m.sync(m.render(messages, None))
        self.answer_anchor = m.anchor("manual", label="answer")
        self._record(self.answer_anchor, 1)
        policy = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.s.attempts),
            retry=tenacity.retry_if_exception_type(CodeFailed),
            reraise=True,
        )
        try:
            for attempt in policy:
                with attempt:
                    number = attempt.retry_state.attempt_number
                    if number > 1:
                        self._rollback_and_note(number - 1)
                    self._attempt(number)
        except CodeFailed as e:
            logger.info("no passing code after %d attempts: %s", self.s.attempts, e)
        usage = m.usage()
        return CodingResult(
            prompt=self.prompt,
            tests=self.tests,
            passed=bool(self.results) and self.results[-1].passed,
            attempts=self.results,
            anchors=self.anchors,
            rollbacks=self.rollbacks,
            answer=m.tokenizer.decode(m.token_ids[self.answer_anchor.position :], skip_special_tokens=True),
            tokens_prefilled=usage.prefilled - usage0.prefilled,
            tokens_decoded=usage.decoded - usage0.decoded,
            seconds=time.perf_counter() - t0,
        )

    def _attempt(self, number: int) -> None:
        m = self.m
        temperature = 0.0 if number == 1 else self.s.temperature
        seed = None if number == 1 else self.s.seed + number - 1
        self.emit(CodingEvent("start", number, {"temperature": temperature, "seed": seed}))
        request = GenerateRequest(
            max_new_tokens=self.s.max_new_tokens, temperature=temperature, seed=seed, prefix=self.prefix
        )
        decoded0, text, fence = m.usage().decoded, "", None
        events = m.generate(request)
        try:
            for event in events:
                if event.kind == "text" and event.text:
                    text += event.text
                    self.emit(CodingEvent("text", number, event.text))
                elif event.kind == "anchor" and event.anchor is not None:
                    self._record(event.anchor, number)
                    if event.anchor.kind == "code_block" and fence is None:
                        fence = self.last_fence = event.anchor
                        self.notes_before_fence = len(self.notes)
                if block_closed(text):
                    break  # the answer is the first code block: stop generating at its end
        finally:
            events.close()
        code = extract_code(text) if fence is not None else None
        sandbox = None
        if code is not None:
            sandbox = check_code(code, self.tests, limits=self.s.limits, isolation=self.s.isolation)
        error = "the answer has no code block" if sandbox is None else sandbox.error
        passed = sandbox is not None and sandbox.passed
        result = CodeAttempt(
            number=number,
            text=text,
            code=code,
            passed=passed,
            error=None if passed else error or "the tests failed",
            temperature=temperature,
            seed=seed,
            tokens_decoded=m.usage().decoded - decoded0,
            sandbox=sandbox,
        )
        self.results.append(result)
        self.emit(CodingEvent("attempt", number, result))
        if not passed:
            raise CodeFailed(result.error or "the tests failed")

    def _rollback_and_note(self, failed: int) -> None:
        """Back to the latest code-block anchor (the failed attempt's own, or an earlier
        attempt's when this one opened no code block; the start of the answer when none did),
        then the failure notes the context lost and the new one, so the next attempt reads them."""
        m, error = self.m, self.results[-1].error or "the tests failed"
        assert self.answer_anchor is not None
        target = self.last_fence or self.answer_anchor
        start = m.position
        outcome = m.rollback(target)
        saved = 0 if outcome.rebuilt else target.position
        self.rollbacks.append(
            RollbackRecord(
                anchor_id=target.id,
                from_position=start,
                to_position=outcome.to_position,
                tokens_discarded=start - outcome.to_position,
                tokens_saved=saved,
                rebuilt=outcome.rebuilt,
                reason=error,
            )
        )
        self.emit(CodingEvent("rollback", failed, self.rollbacks[-1]))
        note = code_failure_note(failed, error)
        self.notes.append(note)
        if target is self.answer_anchor:  # nothing of the answer is left: lead-in and notes again
            text = self.lead + "".join(self.notes)
        else:
            text = "".join(self.notes[self.notes_before_fence :])
            kept = m.tokenizer.decode(m.token_ids[self.answer_anchor.position :], skip_special_tokens=True)
            text = text if not kept or kept.endswith("\n") else "\n" + text
        m.append_text(text)
        self.prefix = self.fence_part
        self.emit(CodingEvent("note", failed, note))

    def _record(self, handle: AnchorHandle, attempt: int) -> None:
        record = AnchorRecord(
            id=handle.id, kind=handle.kind, position=handle.position, label=handle.label, step=attempt
        )
        self.anchors.append(record)
        self.emit(CodingEvent("anchor", attempt, record))
