"""Tools: typed Python callables with a pydantic argument model and a JSON schema.

@tool(timeout=5)
def get_weather(city: str, unit: Literal["c", "f"] = "c") -> dict:
    "Current weather for a city."
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import json
from collections.abc import Callable
from typing import Any, overload

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from .errors import ToolArgumentsInvalid, ToolTimeout

_EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="freetoken-tool")


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
    ) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.description = (description or inspect.getdoc(fn) or "").strip()
        self.args_model = args_model or _model_from_signature(fn, self.name)
        self.timeout = timeout
        self.retries = retries  # overrides RetryPolicy.tool_attempts for this tool when set
        self.is_async = inspect.iscoroutinefunction(fn)

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
        """Run the tool with validated `args`, under its timeout (ToolTimeout when exceeded)."""
        kwargs = {k: getattr(args, k) for k in type(args).model_fields}
        if self.is_async:
            coro = self.fn(**kwargs)
        else:
            loop = asyncio.get_running_loop()
            coro = loop.run_in_executor(_EXECUTOR, functools.partial(self.fn, **kwargs))
        try:
            return await asyncio.wait_for(coro, self.timeout)
        except asyncio.TimeoutError as e:
            if isinstance(e, ToolTimeout):
                raise
            raise ToolTimeout(f"tool '{self.name}' timed out after {self.timeout}s") from e

    def call(self, args: BaseModel) -> Any:
        """Synchronous `acall` (sync tools without a timeout run inline)."""
        if not self.is_async and self.timeout is None:
            return self.fn(**{k: getattr(args, k) for k in type(args).model_fields})
        return asyncio.run(self.acall(args))

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
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None, /, **options: Any
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a Tool from a function: `@tool` or `@tool(timeout=5, name=..., args_model=...)`."""
    if fn is not None:
        return Tool(fn, **options)
    return lambda f: Tool(f, **options)
