"""A chat-completions request, checked before it is queued and made ready for the engine after.

Everything a request can get wrong is found here and answered with a 400 naming the field: the
model name (404), roles and content, tool-call arguments that are not JSON objects, a tool_choice
naming no offered tool, schemas too costly to compile or without a finite value (`check_schema`)
or that the grammar compiler rejects, unsupported options, and a prompt (plus the requested
completion) over the model's context.

Three steps: `check` (on the HTTP side, time linear in the body, no tokenizer), `compile_grammars`
(on the HTTP side too, on the grammar factory's one compile thread, with a deadline: a schema
compiled on the engine worker held every client until it was done, a 380-byte one more than 90 s)
and `prepare` (on the engine worker, inside the bounded queue: render, tokenize; it stops when the
client left). The messages as the template takes them: request_messages.py; a prompt bounded
before it is rendered: prompt_bound.py; the continue_final_message prompt: continue_final.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from freetoken_agents import SchemaRejected, user_sources
from freetoken_agents.constrained import TextGrammar
from freetoken_agents.engine import ChatTemplateError
from freetoken_agents.errors import GrammarCompilerBusy
from freetoken_agents.grammar_cache import CompiledGrammar
from freetoken_agents.schema_check import check_schema

from ..chat_turn import MAX_CHOICES, no_calls
from .continue_final import open_final_message
from .errors import OpenAIError, bad_request
from .extensions import (
    check_extensions,
    continue_final_message,
    generation_prompt,
    output_constraint,
    template_kwargs,
)
from .extensions import max_tokens as extension_max_tokens
from .prompt_bound import bound_prompt, too_long
from .request_messages import chat_messages
from .schemas import ChatCompletionRequest, NamedToolChoice

if TYPE_CHECKING:
    from freetoken_agents.model import FreeTokenModel


@dataclass(frozen=True)
class PreparedRequest:
    """What the engine worker needs for one request.

    ids: the prompt's token ids (the messages and tools in the model's chat template).
    tools: the offered tools, as OpenAI tool dicts; tools_on: the reply may call them (with
        tool_choice "none": `chat_turn.no_calls`, under which the decoder lets no call start).
    force: None (the model decides), '*' (some tool must be called) or the forced tool's name.
    json_schema: the whole reply decodes under this schema (response_format), else None.
    grammar: the whole reply decodes under this regex / EBNF grammar / choice (the peers'
        guided_regex, grammar, guided_choice...), else None.
    max_tokens: the bound on sampled tokens, for the free text and for each tool call (text the
        grammar forces, keys and punctuation, is not sampled and not counted).
    call_sources: relevant calls, the model's default (`FreeTokenModel.relevant_calls`): the user's
        messages, which the calls the model decides must be about; None: any offered tool.
    Sampling (temperature ... frequency_penalty, seed) as the engine's SamplingParams takes it;
    logprobs: None, or the alternatives per token (top_logprobs); n: replies to decode.
    """

    ids: list[int]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tools_on: bool = False
    force: str | None = None
    json_schema: dict[str, Any] | None = None
    grammar: TextGrammar | None = None
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    logit_bias: dict[int, float] = field(default_factory=dict)
    call_sources: tuple[str, ...] | None = None


@dataclass(frozen=True)
class CheckedRequest:
    """A request `check` found sound, waiting for the worker to `prepare` it (render, tokenize,
    compile: the costly part, done in the queue)."""

    request: ChatCompletionRequest
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tools_on: bool
    force: str | None
    json_schema: dict[str, Any] | None
    schemas: dict[str, dict[str, Any]]  # param -> schema the reply may be decoded under
    grammars: tuple[CompiledGrammar, ...] = ()  # their grammars (`compile_grammars`)
    grammar: TextGrammar | None = None  # the reply's regex / EBNF / choice constraint
    grammar_param: str = ""  # the field that asked for it


def check(request: ChatCompletionRequest, backend: FreeTokenModel, *, model_name: str) -> CheckedRequest:
    """Everything about `request` that costs time linear in its size and touches no tokenizer:
    fields, tool choice, and the cost of every schema (`check_schema`); OpenAIError if bad."""
    if request.model is not None and request.model != model_name:  # left out: the one model
        raise OpenAIError(
            404,
            f"The model `{request.model}` does not exist; this server serves `{model_name}`.",
            param="model",
            code="model_not_found",
        )
    _refuse_unsupported(request)
    check_extensions(request)  # llama-server / vLLM fields: honoured or a 400 naming them
    extension_max_tokens(request)
    tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
    names = [t["function"]["name"] for t in tools]
    choice = request.tool_choice if request.tool_choice is not None else "auto"
    force = _force(choice, names)
    tools_on = bool(tools) and choice != "none"
    json_schema = _response_schema(request, tools_on and force is None)
    constraint = output_constraint(request)  # vLLM's guided_* / structured_outputs, llama-server's
    grammar = None
    if constraint is not None:
        if tools_on:  # vLLM refuses guided decoding with a named tool_choice; `auto` would end it
            raise bad_request(
                f"{constraint.param} with tools is supported under tool_choice 'none' only (the "
                "tools stay in the prompt, the reply follows the constraint)",
                param=constraint.param,
            )
        json_schema, grammar = constraint.schema, constraint.grammar
    if json_schema is not None and force is not None:
        json_schema = None  # a forced call is the whole reply; response_format applies to text
    schemas: dict[str, dict[str, Any]] = {}
    if tools_on:
        for tool in tools:
            schemas[f"tools.{tool['function']['name']}"] = tool["function"].get("parameters") or {
                "type": "object"
            }
        if not backend.parser.needs_name_in_prefix():  # a call's body names the tool: one schema
            chosen = tools if force in (None, "*") else [t for t in tools if t["function"]["name"] == force]
            schemas["tools"] = backend.parser.body_schema(chosen)  # what a call decodes under
    if json_schema is not None:
        param = constraint.param if constraint is not None else "response_format.json_schema.schema"
        schemas[param] = json_schema
    for param, schema in schemas.items():
        try:
            check_schema(schema)
        except SchemaRejected as e:
            raise bad_request(f"{param}: {e}", param=param) from None
    return CheckedRequest(
        request,
        chat_messages(request),
        tools,
        tools_on,
        force,
        json_schema,
        schemas,
        grammar=grammar,
        grammar_param=constraint.param if constraint is not None and grammar is not None else "",
    )


COMPILE_TIMEOUT_S = 10.0  # default deadline of a request's grammar compile (ServerConfig)


def compile_grammars(checked: CheckedRequest, backend: FreeTokenModel, *, timeout: float) -> CheckedRequest:
    """`checked` with the grammars of its schemas and its regex or grammar, compiled on the compile
    thread before the request queues for the engine (`GrammarFactory.precompile`), each waiting
    at most `timeout` s for that thread and `timeout` s for its compile: a costly compile delays
    its own request only. OpenAIError: 400 naming the param for a schema the compiler refuses or
    that did not compile in time, 503 when other requests' compiles held the thread."""
    grammars = backend.grammars()  # xgrammar is there: the server does not start without it
    named = backend.parser.needs_name_in_prefix()  # a call's body is its tool's parameters alone
    jobs: list[tuple[str, str, Callable[[], CompiledGrammar]]] = []  # param, what it holds, compile
    for param, schema in checked.schemas.items():
        body = backend.parser.body_format if named and param.startswith("tools.") else "json"
        jobs.append(
            (param, "JSON schema", partial(grammars.precompile, schema, body_format=body, timeout=timeout))
        )
    if checked.grammar is not None:
        what = "regex" if checked.grammar.kind == "regex" else "grammar"
        jobs.append(
            (checked.grammar_param, what, partial(grammars.precompile_text, checked.grammar, timeout=timeout))
        )
    compiled = []
    for param, what, job in jobs:
        try:
            compiled.append(job())
        except SchemaRejected as e:
            # the cache's deadline message speaks of JSON schemas; a regex or grammar has no other
            why = str(e) if what == "JSON schema" else f"the {what} did not compile within {timeout:g} s"
            raise bad_request(f"{param}: {why}", param=param) from None
        except GrammarCompilerBusy as e:
            raise OpenAIError(
                503,
                f"{param}: {e}",
                type="server_error",
                param=param,
                code="grammar_compiler_busy",
                headers={"Retry-After": str(max(1, math.ceil(timeout)))},
            ) from None
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with the compiler's message
            raise _not_compiled(e, param, what) from None
    return dataclasses.replace(checked, grammars=tuple(compiled))


def prepare(
    checked: CheckedRequest, backend: FreeTokenModel, *, cancelled: Callable[[], bool] = lambda: False
) -> PreparedRequest | None:
    """Render and tokenize the prompt (on the engine worker, one request at a time); None as soon
    as `cancelled()` (the client left). OpenAIError (400) for a prompt over the context. A prompt
    far over the context is refused after tokenizing about a context's worth of it
    (`prompt_bound.bound_prompt`), never all of it. Its grammars were compiled before (`compile_grammars`):
    they go back in the cache here, for the reply to find."""
    request = checked.request
    limit = backend.max_context
    if not bound_prompt(checked, backend, limit, cancelled):
        return None
    try:
        if continue_final_message(request):  # vLLM's: the reply continues the last assistant message
            ids = open_final_message(
                checked.messages, checked.tools or None, template_kwargs(request), backend
            )
        else:
            prompt_header = generation_prompt(request)  # vLLM's add_generation_prompt (default true)
            ids = backend.render(
                checked.messages,
                checked.tools or None,
                generation_prompt=prompt_header,
                variables=template_kwargs(request),  # vLLM's chat_template_kwargs
            )
    except ChatTemplateError as e:  # e.g. a message order or role the model's template refuses
        raise bad_request(str(e), param="messages") from None
    prompt = len(ids)
    if prompt + 1 > limit:
        raise too_long(limit, prompt)
    requested = extension_max_tokens(request)  # max_completion_tokens, max_tokens or n_predict
    if requested is not None and prompt + requested > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt + requested} tokens ({prompt} in the messages, {requested} in the completion). "
            "Please reduce the length of the messages or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    backend.grammars().keep(*checked.grammars)  # others' may have pushed them out while it waited
    calls: dict[str, Any] = {
        "tools": checked.tools,
        "tools_on": checked.tools_on,
        "call_sources": tuple(user_sources(checked.messages)) if backend.relevant_calls else None,
        "logit_bias": _logit_bias(request.logit_bias, backend.vocab_size),
    }
    if (
        checked.tools
        and request.tool_choice == "none"
        and checked.json_schema is None
        and checked.grammar is None
    ):
        # the prompt shows the tools; the decoder lets no call start
        calls = {**no_calls(backend, calls["logit_bias"]), "tools_on": True}
    return PreparedRequest(
        ids=ids,
        force=checked.force,
        json_schema=checked.json_schema,
        grammar=checked.grammar,
        max_tokens=requested if requested is not None else limit - prompt,
        temperature=request.temperature if request.temperature is not None else 1.0,
        top_p=request.top_p,
        top_k=request.top_k if request.top_k is not None and request.top_k > 0 else None,  # -1, 0: off
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty if request.repetition_penalty is not None else 1.0,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        seed=request.seed,
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        n=request.n or 1,
        stop=request.stop_strings,
        **calls,
    )


def _refuse_unsupported(request: ChatCompletionRequest) -> None:
    if request.n is not None and request.n > MAX_CHOICES:
        raise bad_request(f"n={request.n}: at most {MAX_CHOICES} choices per request", param="n")
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
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


def _not_compiled(error: Exception, param: str, what: str) -> OpenAIError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    first = _SOURCE_PREFIX.sub("", first)  # "[14:15:41] /project/cpp/x.cc:5082: " is noise here
    return bad_request(f"{param}: the {what} cannot be compiled: {first}", param=param)


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
