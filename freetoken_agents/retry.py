"""RetryPolicy: which failures retry, how often and with what backoff, mapped onto tenacity.

Two retry scopes, both run by tenacity (no hand-written loop):
- tool scope: transient errors (RetryableToolError, TimeoutError, ConnectionError, `transient`)
  re-run the tool itself, with exponential backoff; the model's state is untouched.
- model scope: ModelCausedError (and `model_errors` raised by a tool: ValueError, KeyError,
  LookupError, pydantic ValidationError) roll back to the anchor before the call, append a failure
  note and regenerate. Anything else a tool raises (TypeError included) is a ToolExecutionError.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tenacity
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import ModelCausedError, RetryableToolError

DEFAULT_NOTE = "[attempt {attempt} failed: {tool}: {error}. Call the tool again, fixing the problem.]"
"""No newline at the end: the model's next token follows the note directly, as in the embedded
model's training dialogues (`recipes/tiny/corpus.py`), where the call marker comes right after it;
after "...]\n" the embedded model wrote the call's JSON without its `<tool_call>` marker, so no
call parsed and the retry became a final answer holding the raw call."""


class RetryPolicy(BaseModel):
    """How the agent retries. Times are seconds."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    tool_attempts: int = Field(default=3, ge=1, description="tries of one tool call on transient errors")
    model_attempts: int = Field(default=3, ge=1, description="generations of one call on model errors")
    initial_backoff: float = Field(default=0.05, ge=0, description="first wait between tool tries")
    max_backoff: float = Field(default=2.0, ge=0, description="cap of the exponential backoff")
    jitter: float = Field(default=0.0, ge=0, description="random extra wait, up to this")
    model_backoff: float = Field(default=0.0, ge=0, description="wait before a regeneration")
    transient: tuple[type[BaseException], ...] = (RetryableToolError, TimeoutError, ConnectionError)
    model_errors: tuple[type[BaseException], ...] = Field(
        default=(ValueError, KeyError, LookupError, ValidationError),
        description=(
            "exceptions a tool raises on bad input: sent back to the model, not propagated. "
            "TypeError is left out on purpose: it is almost always a bug in the tool, so it "
            "propagates as ToolExecutionError instead of being retried"
        ),
    )
    failure_note: str | Callable[..., str] = Field(
        default=DEFAULT_NOTE,
        description="format string (attempt, tool, arguments, error) or callable(**same) -> text",
    )
    keep_failure_notes: bool = Field(
        default=True, description="keep notes in the history after the retried call succeeds"
    )

    def note(self, *, attempt: int, tool: str | None, arguments: Any, error: BaseException) -> str:
        """The compact text appended after rollback."""
        fields = dict(attempt=attempt, tool=tool or "tool call", arguments=arguments, error=_short(error))
        if callable(self.failure_note):
            return self.failure_note(**fields)
        return self.failure_note.format(**fields)

    def is_transient(self, error: BaseException) -> bool:
        return isinstance(error, self.transient) and not isinstance(error, ModelCausedError)

    def tool_retrying(
        self,
        attempts: int | None = None,
        before_sleep: Callable[[tenacity.RetryCallState], None] | None = None,
    ) -> tenacity.AsyncRetrying:
        """Tenacity controller for the tool scope (raises tenacity.RetryError when exhausted)."""
        wait: Any = tenacity.wait_exponential(multiplier=self.initial_backoff, max=self.max_backoff)
        if self.jitter:
            wait = wait + tenacity.wait_random(0, self.jitter)
        return tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(attempts or self.tool_attempts),
            wait=wait,
            retry=tenacity.retry_if_exception(self.is_transient),
            before_sleep=before_sleep,
            reraise=False,
        )

    def model_retrying(
        self, before_sleep: Callable[[tenacity.RetryCallState], None] | None = None
    ) -> tenacity.AsyncRetrying:
        """Tenacity controller for the model scope (raises tenacity.RetryError when exhausted)."""
        return tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(self.model_attempts),
            wait=tenacity.wait_fixed(self.model_backoff),
            retry=tenacity.retry_if_exception_type(ModelCausedError),
            before_sleep=before_sleep,
            reraise=False,
        )


def _short(error: BaseException, limit: int = 160) -> str:
    text = getattr(error, "message", None) or str(error) or type(error).__name__
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
