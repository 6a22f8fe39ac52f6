"""The Responses API wire format (POST /v1/responses), as pydantic models: the text and
function-calling subset the openai-agents SDK uses.

Input items: `message` (role user / system / developer / assistant; content a string or
`input_text` / `output_text` parts), `function_call`, `function_call_output`, and `reasoning`
(accepted and left out of the prompt, as chat templates leave out past reasoning). Tools: type
`function`. Nothing is stored: `store` is answered false, and what needs a stored response
(`previous_response_id`, `conversation`, `background`) is refused with a 400 naming the field, as
is any other field whose effect the server cannot give.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from .schemas import MAX_MESSAGES

_LENIENT = ConfigDict(extra="ignore")


# ---- request ------------------------------------------------------------------------------------
class TextPart(BaseModel):
    model_config = _LENIENT
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(BaseModel):
    model_config = _LENIENT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(BaseModel):
    model_config = _LENIENT
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = _LENIENT
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[TextPart]


class ReasoningItem(BaseModel):
    """A past reasoning item: accepted, not rendered (templates drop past reasoning)."""

    model_config = _LENIENT
    type: Literal["reasoning"]


class UnknownItem(BaseModel):
    """An item of a type the server does not take (`item_reference`, `input_image` calls, ...):
    never valid, so the 400 names `input[i].type` and the types it may be."""

    model_config = _LENIENT
    type: Literal["message", "function_call", "function_call_output", "reasoning"]


ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning", "unknown"})
"""The tags of the input item union: never part of a field's name in an error."""


def _item_type(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ITEM_TYPES else "unknown"  # an "easy" input message has no type


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[UnknownItem, Tag("unknown")],
    Discriminator(_item_type),
]


class FunctionTool(BaseModel):
    model_config = _LENIENT
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON under `schema` (structured output)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _LENIENT
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses. `max_output_tokens` bounds the free text and each function call's
    sampled tokens (as `max_tokens` does for chat); absent, a reply may run to the end of the
    context."""

    model_config = _LENIENT

    model: str
    input: str | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = Field(default=None, max_length=256)  # scopes prefix reuse (with the API key)
    # refused when set (a 400 naming them): nothing is stored, one reply per request
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None


# ---- response -----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    """An output id in OpenAI's form: `resp_`, `msg_`, `fc_` or `rs_` and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="input tokens whose KV was reused, not prefilled")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The response (`object` "response"), whole or as the stream's lifecycle events carry it.
    `output`: items as dicts (`responses_output.py` builds them)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    completed_at: int | None = None
    model: str
    output: list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: None = None
    store: bool = False
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
