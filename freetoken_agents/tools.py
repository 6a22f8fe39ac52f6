"""Tools: typed Python callables with a pydantic argument model and a JSON schema.

@tool(timeout=5)
def get_weather(city: str, unit: Literal["c", "f"] = "c") -> dict:
    "Current weather for a city."

How a call runs. An async tool runs on the caller's event loop under its timeout. A sync tool runs
on a fresh daemon thread of its own, one per call: a call that hangs holds only its own thread,
never one another tool needs, and a daemon thread never keeps the interpreter from exiting. A
timed-out thread cannot be stopped (Python threads cannot be killed); it is abandoned
(`abandoned_calls()` counts those still running). A tool marked `process=True` runs in a fresh
process per call, killed at its timeout: for tools that may spin or leak. It must be a module-level
function (the process imports it by name) with picklable arguments and result.

What the model sees of a result is `result_text(result, max_chars)`: strings as they are, other
values as JSON, cut at `max_chars` with a visible note, in time and memory bounded by the cap
whatever the result's size (the Agent's `max_result_chars`, by default `default_result_chars`).
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import inspect
import json
import logging
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any, overload

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from .errors import ToolArgumentsInvalid, ToolTimeout
from .sync_bridge import run_sync

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # a rough estimate for English text under BPE tokenizers
RESULT_CONTEXT_SHARE = 0.25  # the share of the context one tool result may take, at most
DEFAULT_RESULT_CHARS = 16_000  # the cap when the model does not say how long its context is

_abandoned: set[threading.Thread] = set()  # threads of timed-out calls still running
_abandoned_lock = threading.Lock()


def abandoned_calls() -> int:
    """Sync tool calls that timed out and whose threads are still running."""
    with _abandoned_lock:
        return sum(1 for t in _abandoned if t.is_alive())


def default_result_chars(max_context: int | None) -> int:
    """The default cap on a result's characters: a quarter of the context at ~4 characters per
    token (`DEFAULT_RESULT_CHARS` when the context length is unknown), at least 256."""
    if not max_context:
        return DEFAULT_RESULT_CHARS
    return max(256, int(max_context * RESULT_CONTEXT_SHARE * CHARS_PER_TOKEN))


def result_text(result: Any, max_chars: int | None = None) -> str:
    """`result` as the model reads it: a string as is, a pydantic model as its JSON, anything else
    as `json.dumps(result, ensure_ascii=False, default=str)` (`str(result)` if that fails); cut at
    `max_chars` characters with a note saying so. A string is sliced and a structure encoded
    lazily up to the cap, so a huge result costs time and memory in proportion to the cap."""
    if isinstance(result, str):
        text, total = result, len(result)
    else:
        total = None
        if isinstance(result, BaseModel):
            text = result.model_dump_json()  # (pydantic has no lazy encoder)
        else:
            try:
                text = _json_head(result, max_chars)
            except (TypeError, ValueError):
                text = str(result)
    if max_chars is None or len(text) <= max_chars:
        return text
    size = f"{total:,} characters" if total is not None else f"more than {max_chars:,} characters"
    return f"{text[:max_chars]}\n[truncated: the result had {size}; only the first {max_chars:,} are shown]"


def _json_head(result: Any, limit: int | None) -> str:
    """The JSON text of `result` (as json.dumps writes it), only its first `limit` + 1 characters
    when `limit` is given: the pure-Python encoder yields pieces lazily, and it stops there."""
    if limit is None:
        return json.dumps(result, ensure_ascii=False, default=str)
    head: list[str] = []
    size = 0
    for piece in json.JSONEncoder(ensure_ascii=False, default=str).iterencode(result):
        head.append(piece[: limit + 1 - size])
        size += len(head[-1])
        if size > limit:
            break
    return "".join(head)


class Tool:
    """A callable the model may call. `args_model` validates arguments; `json_schema()` is the
    OpenAI-style function entry the chat template renders; `timeout` is in seconds (None: none)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        args_model: type[BaseModel] | None = None,
        timeout: float | None = None,
        retries: int | None = None,
        process: bool = False,
    ) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.description = (description or inspect.getdoc(fn) or "").strip()
        self.args_model = args_model or _model_from_signature(fn, self.name)
        self.timeout = timeout
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

    async def acall(self, args: BaseModel) -> Any:
        """Run the tool with validated `args`, under its timeout (ToolTimeout when exceeded):
        async tools on this loop, sync ones on a thread (or process) of their own (module docstring)."""
        kwargs = {k: getattr(args, k) for k in type(args).model_fields}
        if self.is_async:
            coro = self.fn(**kwargs)
        elif self.process:
            coro = _in_process(self.fn, kwargs, self.name)
        else:
            coro = _in_thread(self.fn, kwargs, self.name)
        try:
            return await asyncio.wait_for(coro, self.timeout)
        except asyncio.TimeoutError as e:
            if isinstance(e, ToolTimeout):
                raise
            raise ToolTimeout(f"tool '{self.name}' timed out after {self.timeout}s") from e

    def call(self, args: BaseModel) -> Any:
        """Synchronous `acall` (sync tools without a timeout or process run inline)."""
        if not self.is_async and self.timeout is None and not self.process:
            return self.fn(**{k: getattr(args, k) for k in type(args).model_fields})
        return run_sync(self.acall(args))

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


async def _in_thread(fn: Callable[..., Any], kwargs: dict[str, Any], name: str) -> Any:
    """`fn(**kwargs)` on a fresh daemon thread (with the caller's context variables). If the
    caller stops waiting (a timeout, a cancelled run) the thread runs on, abandoned."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def work() -> None:
        try:
            outcome = (True, context.run(fn, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller, who decides
            outcome = (False, e)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the caller's loop is closed: nobody waits for this result
            pass
        with _abandoned_lock:
            _abandoned.discard(threading.current_thread())

    thread = threading.Thread(target=work, name=f"freetoken-tool-{name}", daemon=True)
    thread.start()
    try:
        return await future
    except asyncio.CancelledError:
        if thread.is_alive():
            with _abandoned_lock:
                _abandoned.add(thread)
            logger.warning("tool '%s' was abandoned while still running (its thread runs on)", name)
        raise


async def _in_process(fn: Callable[..., Any], kwargs: dict[str, Any], name: str) -> Any:
    """`fn(**kwargs)` in a fresh spawned process, killed if the caller stops waiting."""
    spawn = multiprocessing.get_context("spawn")
    receiver, sender = spawn.Pipe(duplex=False)
    target = (fn.__module__, fn.__qualname__)
    process = spawn.Process(
        target=_process_main, args=(*target, kwargs, sender), name=f"freetoken-tool-{name}", daemon=True
    )
    process.start()
    sender.close()  # the child holds its own end: EOF here when it exits

    def receive() -> tuple[bool, Any] | None:
        try:
            return receiver.recv()
        except EOFError:  # it exited without a result; only the `finally` below joins it: two
            return None  # threads in waitpid let one return before the child is reaped

    try:
        outcome = await _in_thread(receive, {}, f"{name}-result")
    finally:
        if process.is_alive():
            process.kill()
        await _in_thread(process.join, {}, f"{name}-join")
        receiver.close()
    if outcome is None:
        raise RuntimeError(f"the tool's process exited with code {process.exitcode}, no result")
    ok, value = outcome
    if ok:
        return value
    raise value


def _process_main(module: str, qualname: str, kwargs: dict[str, Any], sender: Any) -> None:
    """A tool process: import the tool by name, run it, send (ok, result or error) back."""
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
        fn = found.fn if isinstance(found, Tool) else found
        outcome: tuple[bool, Any] = (True, fn(**kwargs))
    except BaseException as e:  # noqa: BLE001 - sent to the caller, who decides
        outcome = (False, e)
    try:
        sender.send(outcome)
    except Exception as e:  # noqa: BLE001 - an unpicklable result or error: say what it was
        sender.send(
            (
                False,
                RuntimeError(f"the tool's {'result' if outcome[0] else 'error'} cannot be sent back: {e}"),
            )
        )
    sender.close()


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


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    args_model: type[BaseModel] | None = None,
    timeout: float | None = None,
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
