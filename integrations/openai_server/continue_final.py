"""The prompt of vLLM's continue_final_message: the reply continues the last assistant message.

The messages rendered as transformers builds that prompt, ending right after the last message's
text, without what the chat template writes after it (the end-of-turn token and the like).
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from freetoken_agents.engine import encode_plain, render_chat
from freetoken_agents.parsers import with_template_call_ids

from .errors import bad_request

if TYPE_CHECKING:
    from freetoken_agents.model import FreeTokenModel


SUFFIX_TOKENS = 64  # tokens searched from the prompt's end for the end of turn to remove


def open_final_message(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    variables: dict[str, Any] | None,
    backend: FreeTokenModel,
) -> list[int]:
    """The prompt of vLLM's continue_final_message, as transformers builds it: the messages
    rendered, ending right after the last (assistant) message's text, without what the template
    writes after it (the end-of-turn token and the like), so the reply continues that text. The
    template is rendered once as text with a unique tag after that text (what follows the tag is
    the suffix), and the engine's own ids of the messages (its untrusted spans kept) lose the
    trailing tokens that decode to the suffix; text of a token that straddles the cut is
    tokenized again. A 400 when the template drops the text or the suffix cannot be found."""
    tag = f"FTCONTINUE{secrets.token_hex(8)}"
    tagged = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + tag}]
    # the call ids `backend.render` writes (a Mistral template refuses others)
    text = render_chat(
        backend.tokenizer,
        with_template_call_ids(tagged),
        tools,
        add_generation_prompt=False,
        variables=variables,
    )
    at = text.rfind(tag)
    if at == -1:
        raise bad_request(
            "continue_final_message: the chat template does not write the last message's text",
            param="continue_final_message",
        )
    suffix = text[at + len(tag) :]
    ids = backend.render(messages, tools, generation_prompt=False, variables=variables)
    if not suffix:
        return ids
    tokenizer = backend.tokenizer
    for k in range(len(ids) - 1, max(-1, len(ids) - 1 - SUFFIX_TOKENS), -1):
        tail = tokenizer.decode(ids[k:], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if tail.endswith(suffix):
            head = tail[: len(tail) - len(suffix)]  # the message's end, in a token shared with it
            if "\ufffd" not in head:  # not a cut inside a character's bytes
                return ids[:k] + (encode_plain(tokenizer, head) if head else [])
    raise bad_request(
        "continue_final_message: the end of turn after the last message was not found in the prompt",
        param="continue_final_message",
    )
