"""The agent's error hierarchy. The class of an error decides what the loop does with it.

AgentError
├── ModelCausedError          the model did something wrong: roll back to the anchor before the
│   │                         call, append a compact failure note, regenerate (RetryPolicy.model_attempts)
│   ├── ModelRetry            raised by a tool or a result validator to send a message back
│   ├── ToolCallMalformed     the call could not be parsed (partial, unterminated, bad JSON)
│   ├── UnknownTool           the call names a tool the agent does not have
│   ├── ToolArgumentsInvalid  the arguments failed the tool's pydantic model
│   ├── ResultRejected        the caller's result validator rejected the tool's result
│   └── ToolAborted           the tool did not return: it raised SystemExit / KeyboardInterrupt
│                             (or another BaseException), or its process died; also a
│                             ToolExecutionError naming the tool
├── RetryableToolError        transient: retry the tool itself with backoff, model state untouched
│   └── ToolTimeout           the tool ran past its timeout
├── ToolExecutionError        a bug in the tool or our code: propagates, naming tool and arguments
├── InvalidToolName           a tool's name is not an identifier the model can call (also ValueError)
│   └── DuplicateToolName     two tools of one tool list share a name
├── ToolRetryExhausted        retries ran out; carries every attempt
├── UnexpectedModelBehavior   the model broke the protocol in a way retries cannot fix
├── TokenLimitTooSmall        a forced call or structured output cannot close its JSON in its budget
├── SchemaRejected            a JSON schema too costly to compile, or with no finite value (also ValueError)
├── MemoryLimitReached        the engine's memory limit (KV cache) stopped generation; carries
│                             what the run produced so far
├── ContextConflict           a model context was changed by another caller while a turn was
│                             being generated on it (one context, one caller at a time)
└── MaxStepsExceeded          the run used `max_steps` model turns without a final answer
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .trace import Attempt


class AgentError(Exception):
    """Base of every error the agent raises."""


class ModelCausedError(AgentError):
    """An error the model caused. The loop rolls back to the anchor before the tool call, appends
    `note` (or the RetryPolicy's note) and regenerates, up to `RetryPolicy.model_attempts` times;
    then raises ToolRetryExhausted."""

    def __init__(self, message: str, *, tool: str | None = None, arguments: Any = None) -> None:
        super().__init__(message)
        self.message, self.tool, self.arguments = message, tool, arguments


class ModelRetry(ModelCausedError):
    """Raise inside a tool (or a result validator) when the model's input was wrong and it should
    try again; the message goes into the failure note the model sees."""


class ToolCallMalformed(ModelCausedError):
    """Raised when the model's tool call cannot be parsed (bad JSON, a partial or unterminated
    call). Handled like every ModelCausedError: rollback, note, regenerate."""


class UnknownTool(ModelCausedError):
    """Raised when the model calls a tool name the agent does not have. Rollback, note, regenerate."""


class ToolArgumentsInvalid(ModelCausedError):
    """Raised when the call's arguments fail the tool's pydantic argument model (message: the
    validation errors). Rollback, note, regenerate."""


class ResultRejected(ModelCausedError):
    """Raised when the caller's `result_validator` returns False for a tool's result. Rollback,
    note, regenerate."""


class RetryableToolError(AgentError):
    """Raise inside a tool for a transient failure (a flaky service). The loop retries the tool
    itself with the RetryPolicy's backoff (`tool_attempts`), leaving the model's state untouched;
    TimeoutError and ConnectionError are treated the same way."""


class ToolTimeout(RetryableToolError, TimeoutError):
    """Raised when a tool runs past its `timeout` (seconds). Retried like RetryableToolError. A
    timed-out sync tool's thread cannot be killed; it is abandoned."""


class ToolExecutionError(AgentError):
    """Raised when a tool fails in a way that is neither the model's fault nor transient (a bug).
    Propagates out of `run()` with the tool name and arguments; the original is `__cause__`."""

    def __init__(self, tool: str, arguments: Any, error: BaseException) -> None:
        super().__init__(
            f"tool '{tool}' failed with {type(error).__name__}: {error} (arguments: {arguments!r})"
        )
        self.tool, self.arguments, self.error = tool, arguments, error


class ToolAborted(ToolExecutionError, ModelCausedError):
    """Raised when a tool call did not return at all: the tool raised a BaseException that is not
    an Exception (SystemExit from `sys.exit()`, a KeyboardInterrupt it raised itself, ...) or the
    process of a `process=True` tool ended without a result (`sys.exit`, `os._exit`, a crash).
    Such an exception must not end the host program, so it is converted where it is certain to
    be the tool's own (on the tool's thread or from its process), never a Ctrl-C of the host.
    Handled like any ModelCausedError: rollback, a note saying the tool failed, regenerate (then
    ToolRetryExhausted). The original is `error` and `__cause__`."""


class ToolRetryExhausted(AgentError):
    """Raised when the RetryPolicy's attempts run out, for transient tool errors or for model-caused
    ones. `attempts` holds every try (kind, error, arguments), oldest first."""

    def __init__(self, message: str, attempts: list[Attempt]) -> None:
        super().__init__(
            f"{message} after {len(attempts)} attempts: {attempts[-1].error if attempts else ''}"
        )
        self.attempts = attempts


class InvalidToolName(AgentError, ValueError):
    """Raised when a tool is defined (or handed to an Agent) with a name the model cannot call:
    it must match `tools.TOOL_NAME_PATTERN` (a letter or `_`, then up to 63 letters, digits,
    `_`, `.` or `-`: what OpenAI's function names allow)."""


class DuplicateToolName(InvalidToolName):
    """Raised when one tool list (an Agent's) holds two tools of the same name: the model could
    not tell them apart, and one would otherwise be dropped silently."""


class UnexpectedModelBehavior(AgentError):
    """Raised when the model breaks the protocol irrecoverably (e.g. tool_choice='required' with
    no tools). Propagates."""


class TokenLimitTooSmall(AgentError, ValueError):
    """Raised before decoding when a forced tool call (or a structured output) cannot be completed
    within its token limit: even the shortest JSON its schema allows needs more tokens. The message
    names the limit (`limit`, e.g. "max_call_tokens"), its value and the smallest that would do
    (`needed`). Propagates: raise the limit (a retry would fail the same way)."""

    def __init__(self, message: str, *, limit: str, value: int, needed: int) -> None:
        super().__init__(message)
        self.limit, self.value, self.needed = limit, value, needed


class SchemaRejected(AgentError, ValueError):
    """Raised before a JSON schema (a tool's parameters, a structured output's) reaches the grammar
    compiler when it is over `schema_check`'s limits (values, depth, properties, enum entries,
    refs), uses a non-local or dangling `$ref`, or has no finite value (a `$ref` cycle every value
    must follow). The message is one line naming the limit. Propagates: fix the schema."""


class GrammarCompilerBusy(AgentError, TimeoutError):
    """Raised when a schema's grammar was to compile with a deadline (the server compiles each
    request's schemas on one shared compile thread) and other compiles held that thread past it.
    Nothing is wrong with the schema: retry later."""


class MemoryLimitReached(AgentError):
    """Raised by a run when the engine's memory limit stopped it: the KV cache (or the fast-memory
    budget it shares) could not take another token, during a turn (the model's `generate` ended
    with finish_reason "memory") or while the context was prefilled. The Agent cannot go on
    without memory, so this propagates. `partial_output` is the text the interrupted turn had
    produced (what a caller may still show); `trace` the run so far. Give the engine more KV
    memory (`MemoryBudget(kv_bytes=...)`) or keep runs shorter."""

    def __init__(self, message: str, *, partial_output: str = "", trace: Any = None) -> None:
        shown = partial_output if len(partial_output) <= 80 else partial_output[:77] + "..."
        super().__init__(f"{message}; partial output ({len(partial_output)} characters): {shown!r}")
        self.partial_output, self.trace = partial_output, trace


class ContextConflict(AgentError):
    """Raised when a model context (a FreeTokenModel, or one of its `new_context()`s) is changed by
    another caller while a turn is being generated on it: the turn would otherwise continue from
    a context it did not write. Nothing is mixed silently: the turn stops with this error. Give
    each conversation its own context (`model.new_context()`; an Agent does it for every run)."""


class MaxStepsExceeded(AgentError):
    """Raised when a run takes `max_steps` model turns without a final answer. Propagates; the
    partial trace is on `.trace`."""

    def __init__(self, message: str, trace: Any = None) -> None:
        super().__init__(message)
        self.trace = trace
