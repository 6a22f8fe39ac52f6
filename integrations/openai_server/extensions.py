"""Request fields that llama-server and vLLM define beyond OpenAI's: each is honoured or refused
with a 400 naming it, never silently ignored (a client that sends `grammar` and gets free text
back believes it got what it asked for).

Honoured: `n_predict` (llama-server's max_tokens; -1, its default, means unset; a value that
differs from max_tokens is a 400), `guided_json` (vLLM: a JSON schema, as response_format
json_schema), `add_generation_prompt` (vLLM: false renders the messages without the assistant
header), an empty `chat_template_kwargs`. Refused for now (REFUSED): grammar-guided decoding other
than JSON (`grammar`, `guided_grammar`, `guided_regex`, `guided_choice`, `structured_outputs`),
non-empty `chat_template_kwargs` (the template render takes no extra variables yet),
`continue_final_message`, and the other sampling and output options the peers define that this
server does not implement. A field no peer defines keeps OpenAI's behaviour: ignored.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import bad_request
from .schemas import ChatCompletionRequest

__all__ = ["REFUSED", "check_extensions", "extension_schema", "generation_prompt", "max_tokens"]

REFUSED: dict[str, str] = {
    "grammar": "GBNF grammars are not supported yet; use response_format json_schema",
    "guided_grammar": "grammars are not supported yet; use response_format json_schema",
    "guided_regex": "regex-guided decoding is not supported yet; use a JSON schema with a pattern",
    "guided_choice": "guided_choice is not supported yet; use a JSON schema with an enum",
    "structured_outputs": "use response_format json_schema",
    "guided_decoding_backend": "this server decodes JSON schemas with xgrammar",
    "json_schema": "use response_format json_schema",  # llama-server's top-level field
    "continue_final_message": "continuing the last assistant message is not supported yet",
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
    """A 400 naming the first peer field `request` holds that this server does not honour."""
    extra = request.model_extra or {}
    for name, why in REFUSED.items():
        if name in extra and extra[name] not in (None, False):
            raise bad_request(f"{name} is not supported by this server: {why}", param=name)
    kwargs = extra.get("chat_template_kwargs")
    if kwargs not in (None, {}):
        raise bad_request(
            "chat_template_kwargs is not supported by this server: the chat template renders with "
            "its own variables only",
            param="chat_template_kwargs",
        )


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


def extension_schema(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """vLLM's `guided_json` (a JSON schema, or its JSON text): the reply's schema; None without it.
    A 400 when response_format asks for something else too."""
    schema = (request.model_extra or {}).get("guided_json")
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise bad_request(f"guided_json: not valid JSON ({e.msg})", param="guided_json") from None
    if not isinstance(schema, dict):
        raise bad_request("guided_json must be a JSON schema (an object)", param="guided_json")
    if request.response_format is not None and request.response_format.type != "text":
        raise bad_request("send guided_json or response_format, not both", param="guided_json")
    return schema


def generation_prompt(request: ChatCompletionRequest) -> bool:
    """vLLM's `add_generation_prompt` (default true)."""
    value = (request.model_extra or {}).get("add_generation_prompt", True)
    if not isinstance(value, bool):
        raise bad_request("add_generation_prompt must be true or false", param="add_generation_prompt")
    return value
