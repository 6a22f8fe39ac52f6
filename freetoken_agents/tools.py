"""Tools: typed Python callables with a pydantic argument model and a JSON schema.

@tool(timeout=5)
def get_weather(city: str, unit: Literal["c", "f"] = "c") -> dict:
    "Current weather for a city."

Names. A tool's name must match `TOOL_NAME_PATTERN` (a letter or `_`, then up to 63 letters,
digits, `_`, `.` or `-`, as OpenAI's function names allow): InvalidToolName otherwise. An Agent
refuses two tools of one name (DuplicateToolName) instead of dropping one silently.

Timeouts. Every call runs under a timeout: the tool's own (`timeout=` seconds), else the Agent's
`tool_timeout`, else `DEFAULT_TOOL_TIMEOUT` (60 s). `timeout=None`, given explicitly, runs without
one. A call past its timeout raises ToolTimeout (retried as a transient error).

How a call runs. An async tool runs on an event loop of its own on a fresh daemon thread, so a
tool that blocks its loop (`time.sleep` in an `async def`) stalls only that thread, and the
caller's timeout still ends the wait; on a timeout or a cancelled run the tool's task is
cancelled in its loop. A sync tool runs on a fresh daemon thread of its own, one per call: a call
that hangs holds only its own thread, never one another tool needs, and a daemon thread never
keeps the interpreter from exiting. Context variables of the caller are seen by the tool. A
timed-out thread cannot be stopped (Python threads cannot be killed); it is abandoned
(`abandoned_calls()` counts those still running). A tool marked `process=True` runs in a fresh
process per call, killed at its timeout: for tools that may spin or leak. It must be a module-level
function (the process imports it by name) with picklable arguments and result.

A tool that does not return (it raises SystemExit, a KeyboardInterrupt of its own or another
BaseException that is not an Exception; its process exits or crashes without a result) fails the
call with ToolAborted: it never ends the host program. Only what reaches the caller from the
tool's own thread or process is converted, so a Ctrl-C of the host still stops it. Called
directly with `Tool.call` and `timeout=None`, a sync tool runs inline, as a plain function call.

What the model sees of a result is `result_text(result, max_chars)`: strings as they are, other
values as JSON, cut at `max_chars` with a visible note, in time and memory bounded by the cap
whatever the result's size (the Agent's `max_result_chars`, by default `default_result_chars`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import inspect
import json
import logging
import re
import sys
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, overload

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from .errors import DuplicateToolName, InvalidToolName, ToolArgumentsInvalid, ToolTimeout
from .sync_bridge import run_sync
from .tool_exec import abandoned_calls, run_async_in_thread, run_in_process, run_in_thread
from .tool_results import default_result_chars, result_text

__all__ = [
    "DEFAULT_TOOL_TIMEOUT",
    "TOOL_NAME_PATTERN",
    "UNSET",
    "Tool",
    "abandoned_calls",
    "check_timeout",
    "check_tool_name",
    "default_result_chars",
    "default_tool_timeout",
    "result_text",
    "tool",
    "tools_by_name",
]

logger = logging.getLogger(__name__)

DEFAULT_TOOL_TIMEOUT = 60.0  # seconds a call may run when neither the tool nor the Agent says
TOOL_NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")  # what OpenAI's function names allow


class _Unset(enum.Enum):
    UNSET = "unset"


UNSET = _Unset.UNSET
"""`timeout=UNSET` (the default): not set here, the next level's timeout applies."""
Timeout = float | None | _Unset

# The Agent's `tool_timeout` for the calls of its run (set by `default_tool_timeout`).
_default_timeout: contextvars.ContextVar[Timeout] = contextvars.ContextVar(
    "freetoken_default_tool_timeout", default=UNSET
)


def check_tool_name(name: Any) -> str:
    """`name` if a model can call a tool by it (`TOOL_NAME_PATTERN`), else InvalidToolName."""
    if not isinstance(name, str) or TOOL_NAME_PATTERN.fullmatch(name) is None:
        raise InvalidToolName(
            f"invalid tool name {name!r}: use a letter or '_', then up to 63 letters, digits, '_', '.' or '-'"
        )
    return name


def tools_by_name(tools: Iterable[Tool]) -> dict[str, Tool]:
    """name -> tool for a tool list; DuplicateToolName when two share a name (one would be dropped
    silently), InvalidToolName for a name changed after the tool was made into an invalid one."""
    by_name: dict[str, Tool] = {}
    for t in tools:
        if check_tool_name(t.name) in by_name:
            raise DuplicateToolName(f"two tools are named {t.name!r}: tool names must be unique")
        by_name[t.name] = t
    return by_name


def check_timeout(timeout: Any, what: str = "timeout") -> Timeout:
    """`timeout` if it is UNSET, None or a positive number of seconds, else ValueError."""
    if timeout is UNSET or timeout is None:
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"{what} must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)


@contextlib.contextmanager
def default_tool_timeout(timeout: Timeout) -> Iterator[None]:
    """Within this block (this context: a task, a thread), tools without a timeout of their own
    run under `timeout` instead of `DEFAULT_TOOL_TIMEOUT` (None: none; UNSET: leave as is)."""
    token = _default_timeout.set(check_timeout(timeout, "tool_timeout"))
    try:
        yield
    finally:
        _default_timeout.reset(token)


class Tool:
    """A callable the model may call. `args_model` validates arguments; `json_schema()` is the
    OpenAI-style function entry the chat template renders; `timeout` is in seconds (None: none;
    UNSET: the Agent's `tool_timeout`, else DEFAULT_TOOL_TIMEOUT, see `effective_timeout`)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        args_model: type[BaseModel] | None = None,
        timeout: Timeout = UNSET,
        retries: int | None = None,
        process: bool = False,
    ) -> None:
        self.fn = fn
        self.name = check_tool_name(name or getattr(fn, "__name__", None))
        self.description = (description or inspect.getdoc(fn) or "").strip()
        self.args_model = args_model or _model_from_signature(fn, self.name)
        self.timeout = check_timeout(timeout)
        self.retries = retries  # overrides RetryPolicy.tool_attempts for this tool when set
        self.is_async = inspect.iscoroutinefunction(fn)
        self.process = process
        if process and (self.is_async or "<locals>" in fn.__qualname__ or fn.__name__ == "<lambda>"):
            raise TypeError(
                f"tool '{self.name}': process=True needs a sync function defined at a module's top "
                "level (the tool's process imports it by name)"
            )

    def parameters_schema(self) -> dict[str, Any]:
        """JSON schema of the arguments (an object schema)."""
        schema = self.args_model.model_json_schema()
        schema.pop("title", None)
        for prop in schema.get("properties", {}).values():
            if isinstance(prop, dict):
                prop.pop("title", None)
        return schema

    def json_schema(self) -> dict[str, Any]:
        """The tool as the chat template expects it: {"type": "function", "function": {...}}."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters_schema(),
            },
        }

    def validate(self, arguments: Any) -> BaseModel:
        """Arguments (a dict or a JSON string) -> the validated model. ToolArgumentsInvalid if not."""
        try:
            if isinstance(arguments, str):
                arguments = json.loads(arguments) if arguments.strip() else {}
            if not isinstance(arguments, dict):
                raise ToolArgumentsInvalid(
                    f"arguments must be a JSON object, got {type(arguments).__name__}",
                    tool=self.name,
                    arguments=arguments,
                )
            return self.args_model.model_validate(arguments)
        except json.JSONDecodeError as e:
            raise ToolArgumentsInvalid(
                f"arguments are not JSON: {e}", tool=self.name, arguments=arguments
            ) from e
        except ValidationError as e:
            errors = "; ".join(f"{'.'.join(map(str, x['loc'])) or '(root)'}: {x['msg']}" for x in e.errors())
            raise ToolArgumentsInvalid(errors, tool=self.name, arguments=arguments) from e

    def effective_timeout(self) -> float | None:
        """The seconds a call may run: the tool's `timeout`, else the one `default_tool_timeout`
        set (the Agent's `tool_timeout`), else DEFAULT_TOOL_TIMEOUT; None: no limit."""
        for timeout in (self.timeout, _default_timeout.get()):
            if timeout is not UNSET:
                return timeout
        return DEFAULT_TOOL_TIMEOUT

    async def acall(self, args: BaseModel) -> Any:
        """Run the tool with validated `args` on a thread (or process) of its own, under its
        timeout (ToolTimeout when exceeded); ToolAborted if it does not return (module docstring)."""
        kwargs = {k: getattr(args, k) for k in type(args).model_fields}
        timeout = self.effective_timeout()
        if self.is_async:
            coro = run_async_in_thread(self.fn, kwargs, self.name)
        elif self.process:
            coro = run_in_process(self.fn, kwargs, self.name)
        else:
            coro = run_in_thread(self.fn, kwargs, self.name, tool=True)
        try:
            return await _within(coro, timeout)
        except asyncio.TimeoutError as e:
            if isinstance(e, ToolTimeout):
                raise
            raise ToolTimeout(f"tool '{self.name}' timed out after {timeout}s") from e

    def call(self, args: BaseModel) -> Any:
        """Synchronous `acall` (a sync tool with `timeout=None` and no process runs inline)."""
        if not self.is_async and self.effective_timeout() is None and not self.process:
            return self.fn(**{k: getattr(args, k) for k in type(args).model_fields})
        return run_sync(self.acall(args))

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


def _model_from_signature(fn: Callable[..., Any], name: str) -> type[BaseModel]:
    fields: dict[str, Any] = {}
    hints = _type_hints(fn)
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool '{name}': *args/**kwargs parameters cannot be described to a model")
        annotation = hints.get(pname, Any)
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[pname] = (annotation, default)
    model_name = "".join(p.capitalize() for p in name.split("_")) + "Args"
    return create_model(model_name, __config__=ConfigDict(extra="forbid"), **fields)


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    import typing

    try:
        return typing.get_type_hints(fn, include_extras=True)
    except Exception:  # unresolved forward references: fall back to raw annotations
        return dict(getattr(fn, "__annotations__", {}))


async def _within(coro: Coroutine[Any, Any, Any], timeout: float | None) -> Any:
    """`await coro`, cancelled after `timeout` seconds (TimeoutError). `asyncio.timeout` runs it in
    the caller's task, as a plain await does (`wait_for` wraps it in a task of its own first)."""
    if timeout is None:
        return await coro
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await coro
    return await asyncio.wait_for(coro, timeout)  # pragma: no cover - Python 3.10


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    args_model: type[BaseModel] | None = None,
    timeout: Timeout = UNSET,
    retries: int | None = None,
    process: bool = False,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None, /, **options: Any
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a Tool from a function: `@tool` or `@tool(timeout=5, name=..., args_model=..., process=True)`."""
    if fn is not None:
        return Tool(fn, **options)
    return lambda f: Tool(f, **options)
