"""Whether a prompt is certainly over the model's context, found before it is rendered whole.

A prompt far over the context is refused after tokenizing about a context's worth of its texts
(`bound_prompt`), never all of it; `too_long` is the 400 for a prompt over the context.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from freetoken_agents.engine import encode_plain

from .errors import OpenAIError, bad_request

if TYPE_CHECKING:
    from freetoken_agents.model import FreeTokenModel


class PromptTexts(Protocol):
    """What `bound_prompt` reads of a request (`prepare.CheckedRequest`): its messages and tools."""

    @property
    def messages(self) -> list[dict[str, Any]]: ...

    @property
    def tools(self) -> list[dict[str, Any]]: ...


BOUND_CHUNK = 16_384  # characters tokenized at a time by `bound_prompt`
BOUND_FROM = 65_536  # prompts with fewer characters are tokenized whole at once
CUT_SLACK = 8  # tokens a cut between two chunks may add (a merge across it lost)


def bound_prompt(
    checked: PromptTexts, backend: FreeTokenModel, limit: int, cancelled: Callable[[], bool]
) -> bool:
    """False when cancelled; OpenAIError (400) once the prompt's texts certainly hold more than
    `limit` tokens. Texts are tokenized in chunks cut before a space that follows a non-space (a
    pre-token boundary for BPE tokenizers); each chunk counts CUT_SLACK tokens less than it got, so
    the sum stays a lower bound of the rendered prompt's tokens. A 3.5 MB prompt cost 5 CPU-s
    before it was found too long; now the work stops past about `limit` tokens."""
    texts = [m["content"] for m in checked.messages if isinstance(m.get("content"), str)]
    texts += [json.dumps(checked.tools)] if checked.tools else []
    if sum(map(len, texts)) <= BOUND_FROM:
        return not cancelled()
    longest = _longest_token(backend.tokenizer)
    tokens = 0
    for text in texts:
        for chunk, at_space in _chunks(text):
            if at_space:
                tokens += max(0, len(encode_plain(backend.tokenizer, chunk)) - CUT_SLACK)
            else:  # no pre-token boundary to cut at: no token holds more than `longest` characters
                tokens += len(chunk) // longest
            if cancelled():  # nobody would read the answer
                return False
            if tokens + 1 > limit:
                raise too_long(limit, None)
    return True


def _chunks(text: str) -> Iterator[tuple[str, bool]]:
    """`text` in pieces of about BOUND_CHUNK characters, each with whether both its ends are
    pre-token boundaries (the text's ends, or before a space that follows a non-space); a piece of
    a long run without such a space is cut anywhere (False)."""
    start, clean = 0, True  # clean: `start` is a pre-token boundary
    while len(text) - start > BOUND_CHUNK:
        cut = text.find(" ", start + BOUND_CHUNK, start + 4 * BOUND_CHUNK)
        while cut != -1 and text[cut - 1].isspace():
            cut = text.find(" ", cut + 1, start + 4 * BOUND_CHUNK)
        if cut == -1:
            yield text[start : start + BOUND_CHUNK], False
            start, clean = start + BOUND_CHUNK, False
        else:
            yield text[start:cut], clean
            start, clean = cut, True
    yield text[start:], clean


# per tokenizer object, forgotten with it (an id() key could be reused by another tokenizer)
_LONGEST: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _longest_token(tokenizer: Any) -> int:
    """The most characters one token's text can decode to (its vocabulary string's length is an
    upper bound: byte-level and byte-fallback spellings are never shorter than the text)."""
    if tokenizer not in _LONGEST:
        _LONGEST[tokenizer] = max(1, max(map(len, tokenizer.get_vocab()), default=1))
    return _LONGEST[tokenizer]


def too_long(limit: int, prompt: int | None) -> OpenAIError:
    got = f"in {prompt} tokens" if prompt is not None else f"in more than {limit} tokens"
    return bad_request(
        f"This model's maximum context length is {limit} tokens. However, your messages resulted "
        f"{got}. Please reduce the length of the messages.",
        param="messages",
        code="context_length_exceeded",
    )
