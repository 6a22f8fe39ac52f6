"""The chat-completions wire format, as pydantic models: what a request may hold (checked before it
is queued: a malformed one is a 400 naming the field) and what the server answers.

Fields OpenAI defines that change nothing here are accepted and ignored (`store`,
`metadata`, `parallel_tool_calls`, zero penalties, ...); a field whose effect the server cannot
give (`n` > 1, `logprobs`, non-zero penalties) is refused rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from freetoken_agents.parsers import new_call_id

_LENIENT = ConfigDict(extra="ignore")

MAX_MESSAGES = 2048
"""Most messages one request may hold (more is a 400 naming `messages`, before anything is rendered).
The engine renders and tokenizes in time linear in the messages, but a chat template need not be
(one that looks back over the conversation at each message)."""


# ---- request ------------------------------------------------------------------------------------
class TextPart(BaseModel):
    model_config = _LENIENT
    type: Literal["text"]
    text: str


Content = str | list[TextPart] | None


class FunctionCall(BaseModel):
    model_config = _LENIENT
    name: str
    arguments: str = Field(description="the arguments as a JSON object text")


class ToolCallIn(BaseModel):
    model_config = _LENIENT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(BaseModel):
    model_config = _LENIENT
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(BaseModel):
    model_config = _LENIENT
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(BaseModel):
    model_config = _LENIENT
    role: Literal["assistant"]
    content: Content = None
    tool_calls: list[ToolCallIn] | None = None
    name: str | None = None


class ToolMessage(BaseModel):
    model_config = _LENIENT
    role: Literal["tool"]
    content: Content
    tool_call_id: str


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDef(BaseModel):
    model_config = _LENIENT
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = _LENIENT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    model_config = _LENIENT
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions. `max_completion_tokens` wins over `max_tokens` when both are
    given; absent, a reply may run to the end of the context."""

    model_config = _LENIENT

    model: str
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)  # what torch's generator accepts
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = Field(default=None, max_length=256)  # scopes prefix reuse (with the API key)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)


# ---- response -----------------------------------------------------------------------------------
def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def call_id() -> str:
    return new_call_id()  # nine letters and digits: what every chat template accepts


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV was reused, not prefilled")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # a thinking model's <think> block, as vLLM returns it
    tool_calls: list[ToolCallOut] | None = None


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "freetoken"
    max_model_len: int = Field(description="the context length in tokens (vLLM's field)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
