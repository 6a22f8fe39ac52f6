"""Trace: everything one run did, as small pydantic records; `to_json()` / `Trace.model_validate_json`.
Also what a run hands its caller: AgentEvent (streamed) and AgentResult (returned).

A trace stays small and JSON-safe whatever the tools return: a tool call's record keeps the
result itself only when it is plain JSON whose text fits the cap the model read it under
(`content`, the Agent's `max_result_chars`); otherwise it keeps `content`, the capped text with
its note saying it was cut. `to_json()` never fails on a result: one that is not JSON (set on a
record by hand) is written as its capped text."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_validator

from .tool_results import DEFAULT_RESULT_CHARS, result_text

AnchorKind = Literal["system_prompt", "tool_call", "tool_result", "code_block", "manual"]


class AnchorRecord(BaseModel):
    """An anchor placed in the model's context."""

    id: str = Field(description="backend anchor id")
    kind: AnchorKind
    position: int = Field(description="tokens before the anchor")
    label: str | None = None
    step: int = Field(description="model turn it was placed in")


class RollbackRecord(BaseModel):
    """A rollback to an anchor."""

    anchor_id: str
    from_position: int = Field(description="context length before the rollback")
    to_position: int = Field(description="context length after it (the anchor's position)")
    tokens_discarded: int = Field(description="tokens of the failed attempt removed from the context")
    tokens_saved: int = Field(description="prefix tokens kept: what a re-send would have recomputed")
    rebuilt: bool = Field(default=False, description="anchor failed validation; prefix re-prefilled")
    reason: str = ""


class Attempt(BaseModel):
    """One try of a tool call that failed (or the final success, with error None)."""

    number: int
    scope: Literal["tool", "model"] = Field(description="tool: transient retry; model: rollback")
    tool: str | None = None
    arguments: Any = None
    error: str | None = None
    error_type: str | None = None

    @classmethod
    def from_error(
        cls,
        number: int,
        scope: Literal["tool", "model"],
        error: BaseException,
        tool: str | None = None,
        arguments: Any = None,
    ) -> Attempt:
        """The record of try `number` failing with `error` (its `tool` / `arguments` win)."""
        own_arguments = getattr(error, "arguments", None)
        return cls(
            number=number,
            scope=scope,
            tool=getattr(error, "tool", None) or tool,
            arguments=own_arguments if own_arguments is not None else arguments,
            error=str(error),
            error_type=type(error).__name__,
        )


class ToolCallRecord(BaseModel):
    """A tool call that ran (successfully or not) and its result."""

    id: str
    tool: str
    arguments: Any
    result: Any = None
    content: str | None = Field(
        default=None, description="the result as the model read it (capped at max_result_chars)"
    )
    error: str | None = None
    seconds: float = 0.0

    @model_validator(mode="after")
    def _cap_result(self) -> ToolCallRecord:
        """Keep `result` only if it is plain JSON that `content` shows whole; else `content`
        (the raw result may be huge, or not JSON at all: the module docstring)."""
        if self.content is not None and not _shown_whole(self.result, self.content):
            self.result = self.content
        return self

    @field_serializer("result", when_used="json")
    def _json_result(self, result: Any) -> Any:
        return result if _plain_json(result) else result_text(result, DEFAULT_RESULT_CHARS)


def _shown_whole(result: Any, content: str) -> bool:
    """True when `result` is a string equal to `content`, or plain JSON (no NaN, no non-JSON
    types) whose text is exactly `content`: encoded lazily, so a huge result costs no more than
    `content` does."""
    if isinstance(result, str):
        return result == content
    if result is None or isinstance(result, bool | int | float | list | tuple | dict):
        encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False)
        size = 0
        try:
            for piece in encoder.iterencode(result):
                if content[size : size + len(piece)] != piece:
                    return False
                size += len(piece)
        except (TypeError, ValueError, RecursionError):
            return False
        return size == len(content)
    return False


def _plain_json(result: Any) -> bool:
    try:
        json.dumps(result, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


class Step(BaseModel):
    """One model turn: what the model produced and what followed."""

    number: int
    text: str = ""
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    tokens_prefilled: int = 0
    tokens_decoded: int = 0
    final: bool = False

    def to_messages(self) -> list[dict[str, Any]]:
        """The chat messages this step contributes (assistant turn, then tool results)."""
        if not self.tool_calls:
            return [{"role": "assistant", "content": self.text}]
        calls = [
            {"id": c.id, "type": "function", "function": {"name": c.tool, "arguments": c.arguments}}
            for c in self.tool_calls
        ]
        out: list[dict[str, Any]] = [{"role": "assistant", "content": self.text, "tool_calls": calls}]
        for c in self.tool_calls:
            content = c.content if c.content is not None else result_text(c.result)
            out.append({"role": "tool", "tool_call_id": c.id, "name": c.tool, "content": content})
        return out


class Trace(BaseModel):
    """The record of a run. Token counts are the backend's."""

    started_at: float = Field(default_factory=time.time)
    steps: list[Step] = Field(default_factory=list)
    anchors: list[AnchorRecord] = Field(default_factory=list)
    rollbacks: list[RollbackRecord] = Field(default_factory=list)
    retries: list[Attempt] = Field(default_factory=list)
    tokens_prefilled: int = 0
    tokens_decoded: int = 0
    tokens_reused: int = Field(default=0, description="prefix tokens kept when the context was synced")
    tokens_saved_by_rollback: int = 0

    @property
    def tool_calls(self) -> list[ToolCallRecord]:
        return [c for s in self.steps for c in s.tool_calls]

    def to_json(self, **kwargs: Any) -> str:
        return self.model_dump_json(**kwargs)


class AgentResult(BaseModel):
    """What `Agent.run()` returns: the final answer, the trace and the chat messages."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    output: str
    trace: Trace
    messages: list[dict[str, Any]]


@dataclass(frozen=True)
class AgentEvent:
    """A streamed event. kind: text (delta), anchor, rollback, retry, tool_call, tool_result, final."""

    kind: Literal["text", "anchor", "rollback", "retry", "tool_call", "tool_result", "final"]
    step: int
    data: Any = None
