"""One tool call as the Agent runs it: find the tool, validate the arguments, run it under the
tool-scope retry (transient errors retry the tool, the model untouched), cap what the model will
read of the result, and let the caller's validator judge it.

Errors are sorted by the error hierarchy (`errors.py`): a malformed call, an unknown tool, bad
arguments, a tool's input error (`RetryPolicy.model_errors`) or a rejected result are the model's
(ModelCausedError: the Agent rolls back and regenerates); transient errors that keep failing end
in ToolRetryExhausted; anything else is a ToolExecutionError naming the tool and the arguments.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import tenacity
from pydantic import BaseModel

from .errors import (
    ModelCausedError,
    ModelRetry,
    ResultRejected,
    ToolCallMalformed,
    ToolExecutionError,
    ToolRetryExhausted,
    UnknownTool,
)
from .parsers import ParsedToolCall
from .retry import RetryPolicy
from .tools import Tool, result_text
from .trace import Attempt, ToolCallRecord

ResultValidator = Callable[[str, Any], bool]
"""(tool name, result) -> False to reject the result (or raise ModelRetry with a message)."""

CallEvent = Callable[[Literal["tool_call", "retry"], Any], None]
"""Told of a call about to run ("tool_call", {"tool", "arguments"}) and of each transient failure
that will be retried ("retry", Attempt)."""


class ToolCaller:
    """Runs the model's tool calls for one Agent (see the module docstring). `max_result_chars`:
    the most characters of a result the model reads (longer ones are cut, with a note)."""

    def __init__(
        self,
        tools: Mapping[str, Tool],
        retry: RetryPolicy,
        validator: ResultValidator | None,
        max_result_chars: int,
    ) -> None:
        self.tools, self.retry, self.validator = tools, retry, validator
        self.max_result_chars = max_result_chars

    async def execute(self, call: ParsedToolCall, call_id: str, event: CallEvent) -> ToolCallRecord:
        """Run `call`; its record holds the result and `content`, what the model will read."""
        if call.error:
            raise ToolCallMalformed(call.error, tool=call.name or None, arguments=call.arguments)
        tool = self.tools.get(call.name)
        if tool is None:
            raise UnknownTool(f"no tool named {call.name!r}; tools: {sorted(self.tools)}", tool=call.name)
        args = tool.validate(call.arguments)
        event("tool_call", {"tool": tool.name, "arguments": call.arguments})
        t0 = time.perf_counter()
        result = await self._call_with_retries(tool, args, call.arguments, event)
        content = result_text(result, self.max_result_chars)  # capped before it is ever tokenised
        if self.validator is not None and not self.validator(tool.name, result):
            raise ResultRejected(
                f"the result was rejected: {content[:80]}", tool=tool.name, arguments=call.arguments
            )
        return ToolCallRecord(
            id=call_id,
            tool=tool.name,
            arguments=call.arguments,
            result=result,
            content=content,
            seconds=time.perf_counter() - t0,
        )

    async def _call_with_retries(self, tool: Tool, args: BaseModel, raw_args: Any, event: CallEvent) -> Any:
        """Transient errors retry the tool (model untouched); a tool's input errors become ModelRetry;
        anything else is a ToolExecutionError."""
        attempts: list[Attempt] = []
        try:
            async for attempt in self.retry.tool_retrying(tool.retries):
                with attempt:
                    try:
                        return await tool.acall(args)
                    except Exception as e:
                        if self.retry.is_transient(e):
                            number = attempt.retry_state.attempt_number
                            attempts.append(Attempt.from_error(number, "tool", e, tool.name, raw_args))
                            event("retry", attempts[-1])
                        raise
        except tenacity.RetryError as e:
            raise ToolRetryExhausted(
                f"tool '{tool.name}' kept failing", attempts
            ) from e.last_attempt.exception()
        except ModelCausedError:
            raise
        except self.retry.model_errors as e:
            raise ModelRetry(f"{type(e).__name__}: {e}", tool=tool.name, arguments=raw_args) from e
        except Exception as e:
            raise ToolExecutionError(tool.name, raw_args, e) from e
        raise AssertionError("unreachable: tenacity returns or raises")  # pragma: no cover
