"""A chat-completions request, checked and made ready for the engine before it is queued.

Everything a request can get wrong is found here and answered with a 400 naming the field: the
model name (404), roles and content, tool-call arguments that are not JSON objects, a tool_choice
naming no offered tool, schemas the grammar compiler rejects, unsupported options, and a prompt
(plus the requested completion) over the model's context.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import OpenAIError, bad_request
from .schemas import ChatCompletionRequest, Content, NamedToolChoice

if TYPE_CHECKING:
    from freetoken_agents.model import FreeTokenModel


@dataclass(frozen=True)
class PreparedRequest:
    """What the engine worker needs for one request.

    ids: the prompt's token ids (the messages and tools in the model's chat template).
    tools: the offered tools, as OpenAI tool dicts; tools_on: the reply may call them.
    force: None (the model decides), '*' (some tool must be called) or the forced tool's name.
    json_schema: the whole reply decodes under this schema (response_format), else None.
    max_tokens: the bound on sampled tokens, for the free text and for each tool call (text the
        grammar forces, keys and punctuation, is not sampled and not counted).
    """

    ids: list[int]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tools_on: bool = False
    force: str | None = None
    json_schema: dict[str, Any] | None = None
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: dict[int, float] = field(default_factory=dict)


def content_text(content: Content) -> str:
    """A message's content as one string (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them: assistant tool calls with their
    arguments parsed into dicts (so they render exactly as the model writes them), tool results
    with the name of the call they answer."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, message in enumerate(request.messages):
        if message.role in ("system", "developer"):
            out.append({"role": "system", "content": content_text(message.content)})
        elif message.role == "user":
            out.append({"role": "user", "content": content_text(message.content)})
        elif message.role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": content_text(message.content)}
            calls = []
            for j, call in enumerate(message.tool_calls or []):
                arguments = _arguments(
                    call.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments"
                )
                calls.append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": arguments},
                    }
                )
                if call.id:
                    names[call.id] = call.function.name
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
        else:
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": message.tool_call_id,
                    "name": names.get(message.tool_call_id, ""),
                    "content": content_text(message.content),
                }
            )
    return out


def _arguments(text: str, param: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise bad_request(f"{param}: not valid JSON ({e.msg} at position {e.pos})", param=param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param}: must be a JSON object, got {type(value).__name__}", param=param)
    return value


def prepare(request: ChatCompletionRequest, backend: FreeTokenModel, *, model_name: str) -> PreparedRequest:
    """Check `request` against the served model and render its prompt (OpenAIError if it is bad)."""
    if request.model != model_name:
        raise OpenAIError(
            404,
            f"The model `{request.model}` does not exist; this server serves `{model_name}`.",
            param="model",
            code="model_not_found",
        )
    _refuse_unsupported(request)
    tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
    names = [t["function"]["name"] for t in tools]
    choice = request.tool_choice if request.tool_choice is not None else "auto"
    force = _force(choice, names)
    tools_on = bool(tools) and choice != "none"
    json_schema = _response_schema(request, tools_on and force is None)
    if json_schema is not None and force is not None:
        json_schema = None  # a forced call is the whole reply; response_format applies to text
    grammars = backend.grammars()
    if tools_on:
        for tool in tools:
            _compile(
                grammars,
                tool["function"].get("parameters") or {"type": "object"},
                f"tools.{tool['function']['name']}",
            )
    if json_schema is not None:
        _compile(grammars, json_schema, "response_format.json_schema.schema")
    ids = backend.render(chat_messages(request), tools or None)
    limit, prompt = backend.max_context, len(ids)
    if prompt + 1 > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your messages resulted "
            f"in {prompt} tokens. Please reduce the length of the messages.",
            param="messages",
            code="context_length_exceeded",
        )
    requested = request.max_completion_tokens or request.max_tokens
    if requested is not None and prompt + requested > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt + requested} tokens ({prompt} in the messages, {requested} in the completion). "
            "Please reduce the length of the messages or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return PreparedRequest(
        ids=ids,
        tools=tools,
        tools_on=tools_on,
        force=force,
        json_schema=json_schema,
        max_tokens=requested if requested is not None else limit - prompt,
        temperature=request.temperature if request.temperature is not None else 1.0,
        top_p=request.top_p,
        seed=request.seed,
        stop=request.stop_strings,
        logit_bias=_logit_bias(request.logit_bias, backend.vocab_size),
    )


def _refuse_unsupported(request: ChatCompletionRequest) -> None:
    if request.n not in (None, 1):
        raise bad_request(f"n={request.n} is not supported: this server returns one choice (n=1)", param="n")
    if request.logprobs:
        raise bad_request("logprobs are not supported", param="logprobs")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(request, name):
            raise bad_request(f"{name} is not supported (only 0)", param=name)
    if len(request.stop_strings) > 4:
        raise bad_request("at most 4 stop sequences", param="stop")


def _force(choice: str | NamedToolChoice, names: list[str]) -> str | None:
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise bad_request(
                f"tool_choice names the function {name!r}, which is not in tools {names}", param="tool_choice"
            )
        return name
    if choice == "required":
        if not names:
            raise bad_request("tool_choice 'required' needs tools", param="tool_choice")
        return "*"
    return None


def _response_schema(request: ChatCompletionRequest, auto_tools: bool) -> dict[str, Any] | None:
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if auto_tools:
        raise bad_request(
            "response_format with tools and tool_choice 'auto' is not supported: pass tool_choice "
            "'none' for a JSON answer, or 'required' / a function for a call",
            param="response_format",
        )
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None or not fmt.json_schema.json_schema:
        raise bad_request("response_format json_schema needs json_schema.schema", param="response_format")
    return fmt.json_schema.json_schema


_SOURCE_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")


def _compile(grammars: Any, schema: dict[str, Any], param: str) -> None:
    try:
        grammars.json_schema(schema)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with the compiler's message
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = _SOURCE_PREFIX.sub("", first)  # "[14:15:41] /project/cpp/x.cc:5082: " is noise here
        raise bad_request(f"{param}: the JSON schema cannot be compiled: {first}", param=param) from None


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(
                f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})", param="logit_bias"
            )
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias values lie in [-100, 100], got {value}", param="logit_bias")
        out[token] = value
    return out
