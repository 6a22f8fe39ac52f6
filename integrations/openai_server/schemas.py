"""The chat-completions wire format, as pydantic models: what a request may hold (checked before it
is queued: a malformed one is a 400 naming the field) and what the server answers.

Fields OpenAI defines that change nothing here are accepted and ignored (`store`,
`metadata`, `parallel_tool_calls`, ...); a field whose effect the server cannot give is refused
rather than silently ignored. Sampling fields (OpenAI's and vLLM's `top_k`, `min_p`,
`repetition_penalty`) go to the engine's sampler unchanged (`engine/runtime/sampling.py`).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

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


class StopRequest(BaseModel):
    """A request with a `stop` field (a string, a list of them, or null), which each subclass
    declares where its own fields put it (the first field a 400 names follows their order)."""

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as the tuple of its non-empty strings (a lone string is kept as it is)."""
        stop = self.stop  # type: ignore[attr-defined]
        if stop is None:
            return ()
        return (stop,) if isinstance(stop, str) else tuple(s for s in stop if s)


class ChatCompletionRequest(StopRequest):
    """POST /v1/chat/completions. `max_completion_tokens` wins over `max_tokens` when both are
    given; absent, a reply may run to the end of the context. `model` may be left out (or null):
    the server serves one model, as llama-server and vLLM do. Fields no model here declares are
    kept in `model_extra`: llama-server's and vLLM's are honoured or refused there (`extensions`),
    any other is ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
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
    n: int | None = Field(default=None, ge=1)  # at most `chat_turn.MAX_CHOICES` (`prepare`)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # needs logprobs: true
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's; -1 or 0: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # vLLM's
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # vLLM's; 1: off
    user: str | None = Field(default=None, max_length=256)  # scopes prefix reuse (with the API key)


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


class WireModel(BaseModel):
    """A response object as OpenAI sends it: a field whose value is None goes out as null (a
    chunk's `"finish_reason": null`, every choice's `"logprobs": null`, a tool-call reply's
    `"content": null`; clients index these keys), except the fields in `omit_if_none`, which OpenAI
    leaves out when they hold nothing, unless they were set explicitly (a stream's `"usage": null`,
    sent on every chunk when the client asked for usage)."""

    omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _wire(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        given = self.model_fields_set
        return {k: v for k, v in data.items() if v is not None or k not in self.omit_if_none or k in given}


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(WireModel):
    omit_if_none = frozenset({"reasoning_content", "tool_calls"})
    role: Literal["assistant"] = "assistant"
    content: str | None = None  # null beside tool calls, as OpenAI sends it
    refusal: None = None  # OpenAI's; this server never refuses in words
    reasoning_content: str | None = None  # a thinking model's <think> block, as vLLM returns it
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(BaseModel):
    token: str
    bytes: list[int] | None = None  # the token's UTF-8 bytes (part of a character, for some)
    logprob: float


class TokenLogprob(TopLogprob):
    """One generated token (OpenAI's ChatCompletionTokenLogprob): raw model logprobs."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(WireModel):
    content: list[TokenLogprob] | None = None
    refusal: None = None


class Choice(WireModel):
    index: int = 0
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None  # with `logprobs: true` in the request
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(WireModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None


class ToolCallDelta(WireModel):
    omit_if_none = frozenset({"id", "type", "function"})
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = None


class Delta(WireModel):
    """Only what the chunk adds: OpenAI leaves out every field a delta does not carry."""

    omit_if_none = frozenset({"role", "content", "reasoning_content", "tool_calls"})
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(WireModel):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None  # the chunk's tokens, with `logprobs: true`
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None  # null until the last


class ChatCompletionChunk(WireModel):
    omit_if_none = frozenset({"usage"})  # `"usage": null` only when stream_options.include_usage
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
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
