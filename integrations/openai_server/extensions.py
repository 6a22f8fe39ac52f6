"""Request fields that llama-server and vLLM define beyond OpenAI's: each is honoured or refused
with a 400 naming it, never silently ignored (a client that sends `grammar` and gets free text
back believes it got what it asked for).

Honoured: `n_predict` (llama-server's max_tokens; -1, its default, means unset; a value that
differs from max_tokens is a 400); the reply's constraint (`output_constraint`): vLLM's
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs` (its
newer spelling of them), llama-server's `grammar` (GBNF) and `json_schema`, one at a time, decoded
through xgrammar as response_format is; `add_generation_prompt` (vLLM: false renders the messages
without the assistant header) and `continue_final_message` (vLLM: the reply continues the last
assistant message); `chat_template_kwargs` (variables for the chat template, such as Qwen3's
`enable_thinking`: `template_kwargs`). Refused (REFUSED): the other sampling and output options
the peers define that this server does not implement. A field no peer defines keeps OpenAI's behaviour:
ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from freetoken_agents.constrained import TextGrammar

from .errors import bad_request
from .schemas import ChatCompletionRequest

__all__ = [
    "REFUSED",
    "OutputConstraint",
    "check_extensions",
    "continue_final_message",
    "generation_prompt",
    "max_tokens",
    "output_constraint",
]

REFUSED: dict[str, str] = {
    "guided_decoding_backend": "this server decodes every constraint with xgrammar",
    "guided_whitespace_pattern": "JSON is written compact, without whitespace",
    "ignore_eos": "not supported",
    "min_tokens": "not supported",
    "stop_token_ids": "not supported; use stop strings",
    "include_stop_str_in_output": "not supported",
    "skip_special_tokens": "not supported",
    "spaces_between_special_tokens": "not supported",
    "use_beam_search": "not supported",
    "best_of": "not supported",
    "length_penalty": "not supported",
    "typical_p": "not supported",
    "tfs_z": "not supported",
    "mirostat": "not supported",
    "dynatemp_range": "not supported",
    "echo": "not supported",
    "truncate_prompt_tokens": "not supported",
    "return_tokens_as_token_ids": "not supported",
    "n_probs": "not supported; use logprobs and top_logprobs",
    "documents": "not supported",
    "mm_processor_kwargs": "not supported",
}


def check_extensions(request: ChatCompletionRequest) -> None:
    """A 400 naming the first peer field `request` holds that this server does not honour, or
    holds malformed."""
    extra = request.model_extra or {}
    for name, why in REFUSED.items():
        if name in extra and extra[name] not in (None, False):
            raise bad_request(f"{name} is not supported by this server: {why}", param=name)
    _check_template_kwargs(extra.get("chat_template_kwargs"))
    continue_final_message(request)


RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
"""What the render itself sets (with the tokenizer's special tokens): never a chat_template_kwargs key."""


def _check_template_kwargs(kwargs: Any) -> None:
    """vLLM's `chat_template_kwargs`: a JSON object of variables for the chat template; a 400
    naming a key the render sets itself. A key the template never reads changes nothing, as in
    vLLM and transformers."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be a JSON object", param="chat_template_kwargs")
    for key in kwargs:
        param = f"chat_template_kwargs.{key}"
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise bad_request(f"{param}: the server sets {key} itself", param=param)


def template_kwargs(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """The request's `chat_template_kwargs` (checked by `check_extensions`), for the render."""
    return (request.model_extra or {}).get("chat_template_kwargs")


def continue_final_message(request: ChatCompletionRequest) -> bool:
    """vLLM's `continue_final_message` (default false): the prompt ends inside the last message,
    which must be the assistant's text, and the reply continues it. As in vLLM it needs
    `add_generation_prompt: false` (both true is a 400: a new assistant turn cannot also continue
    the last one)."""
    value = (request.model_extra or {}).get("continue_final_message", False)
    if not isinstance(value, bool):
        raise bad_request("continue_final_message must be true or false", param="continue_final_message")
    if not value:
        return False
    if generation_prompt(request):
        raise bad_request(
            "continue_final_message needs add_generation_prompt: false (both true cannot hold: a new "
            "assistant turn would follow the message to continue)",
            param="continue_final_message",
        )
    last = request.messages[-1] if request.messages else None
    if last is None or last.role != "assistant":
        got = last.role if last is not None else "no message"
        raise bad_request(
            f"continue_final_message: the last message must be the assistant's, got {got}",
            param="continue_final_message",
        )
    if last.tool_calls:
        raise bad_request(
            "continue_final_message: the last message has tool calls; only an assistant text can be "
            "continued",
            param="continue_final_message",
        )
    return True


def max_tokens(request: ChatCompletionRequest) -> int | None:
    """The completion bound: max_completion_tokens, else max_tokens, else llama-server's n_predict
    (-1: unset); a 400 when n_predict disagrees with the bound given."""
    given = request.max_completion_tokens or request.max_tokens
    predict = (request.model_extra or {}).get("n_predict")
    if predict is None or predict == -1:
        return given
    if isinstance(predict, bool) or not isinstance(predict, int) or predict < 1:
        raise bad_request(f"n_predict must be a positive integer or -1, got {predict!r}", param="n_predict")
    if given is not None and given != predict:
        raise bad_request(f"n_predict={predict} differs from max_tokens={given}: send one", param="n_predict")
    return predict


CONSTRAINT_FIELDS: dict[str, str] = {
    "guided_json": "json",  # vLLM: a JSON schema, or its JSON text
    "json_schema": "json",  # llama-server's top-level field: the same
    "guided_regex": "regex",  # vLLM: the reply matches the regex
    "guided_choice": "choice",  # vLLM: the reply is exactly one of the strings
    "guided_grammar": "grammar",  # vLLM: EBNF (xgrammar reads GBNF, llama.cpp's, too)
    "grammar": "grammar",  # llama-server: GBNF
}
"""Top-level fields that constrain the whole reply, and what each holds."""

STRUCTURED_OUTPUTS: dict[str, str] = {
    "json": "json",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
"""vLLM's `structured_outputs` keys (what replaced its guided_* fields) honoured here; any other
key set (structural_tag, whitespace_pattern...) is a 400 naming it."""

MAX_GRAMMAR_CHARS = 65_536  # characters of a regex, grammar, or all of guided_choice's strings
MAX_CHOICES = 4_096  # strings in guided_choice (as many as a schema's enums: `schema_check`)


@dataclass(frozen=True)
class OutputConstraint:
    """What a reply decodes under, as a request's extension field asked: `param` names the field
    as sent ("guided_regex", "structured_outputs.choice"); `schema` (a JSON schema, decoded as
    response_format json_schema is) or `grammar` (a regex, an EBNF grammar, a choice)."""

    param: str
    schema: dict[str, Any] | None = None
    grammar: TextGrammar | None = None


def output_constraint(request: ChatCompletionRequest) -> OutputConstraint | None:
    """The reply's constraint from the peers' fields (CONSTRAINT_FIELDS, `structured_outputs`);
    None without one. A field that is null or an empty string is unset (llama-server's default
    `grammar` is ""). A 400 naming the field for a malformed value, for a second constraint (one
    applies to a reply, as in vLLM), and for one sent with response_format json."""
    extra = request.model_extra or {}
    given = [(name, kind, extra[name]) for name, kind in CONSTRAINT_FIELDS.items() if _set(extra.get(name))]
    outputs = extra.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise bad_request("structured_outputs must be a JSON object", param="structured_outputs")
        for key, value in outputs.items():
            param = f"structured_outputs.{key}"
            if key in STRUCTURED_OUTPUTS:
                if _set(value) and value is not False:
                    given.append((param, STRUCTURED_OUTPUTS[key], value))
            elif value not in (None, False):
                raise bad_request(f"{param} is not supported by this server", param=param)
    if not given:
        return None
    if len(given) > 1:
        first, second = given[0][0], given[1][0]
        raise bad_request(
            f"send {first} or {second}, not both: one constraint applies to a reply", param=second
        )
    param, kind, value = given[0]
    if request.response_format is not None and request.response_format.type != "text":
        raise bad_request(f"send {param} or response_format, not both", param=param)
    if kind == "json":
        return OutputConstraint(param, schema=_schema(value, param))
    if kind == "json_object":
        return OutputConstraint(param, schema={"type": "object"})  # as response_format json_object
    if kind == "choice":
        return OutputConstraint(param, grammar=TextGrammar.choice(_choices(value, param)))
    if not isinstance(value, str):
        raise bad_request(f"{param} must be a string", param=param)
    if len(value) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"{param}: {len(value)} characters; at most {MAX_GRAMMAR_CHARS}", param=param)
    return OutputConstraint(param, grammar=TextGrammar("regex" if kind == "regex" else "ebnf", value))


def _set(value: Any) -> bool:
    return value is not None and value != ""


def _schema(value: Any, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise bad_request(f"{param}: not valid JSON ({e.msg})", param=param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON schema (an object)", param=param)
    return value


def _choices(value: Any, param: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise bad_request(f"{param} must be a non-empty list of strings", param=param)
    if len(value) > MAX_CHOICES:
        raise bad_request(f"{param}: {len(value)} strings; at most {MAX_CHOICES}", param=param)
    if sum(map(len, value)) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"{param}: more than {MAX_GRAMMAR_CHARS} characters in all", param=param)
    return value


def generation_prompt(request: ChatCompletionRequest) -> bool:
    """vLLM's `add_generation_prompt` (default true)."""
    value = (request.model_extra or {}).get("add_generation_prompt", True)
    if not isinstance(value, bool):
        raise bad_request("add_generation_prompt must be true or false", param="add_generation_prompt")
    return value
