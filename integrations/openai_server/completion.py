"""One chat completion on the engine: the shared chat turn (`integrations.chat_turn`: prefix reuse,
the SDK's turn or JSON decoder, stop strings, tool calls parsed by the model's own parser) as the
events the HTTP side turns into a response or SSE chunks.

`run_completion` yields `ContentDelta`s as text is decoded, a `ToolCallDone` as each call's closing
marker is decoded (malformed calls are dropped with a warning), then one `Finished` with the finish
reason and usage. It runs on the engine's step worker; between two events it checks
`cancelled()` and stops (finish_reason "cancelled") when the client left. With n > 1 the choices
come one after the other (`chat_turn.run_chat_choices`: one prefill, forked contexts), each
event tagged with its `choice` and each choice ending with its own `Finished`; with logprobs the
deltas and `Finished` carry `TokenLogprobs`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from freetoken_agents.errors import TokenLimitTooSmall

from ..chat_turn import (
    ChatTurnRequest,
    ContentDelta,
    Event,
    Finished,
    ReasoningDelta,
    ToolCallDone,
    run_chat_choices,
)
from ..prefix_cache import PrefixCache
from ..token_logprobs import TokenLogprobs
from .errors import bad_request
from .prepare import PreparedRequest
from .schemas import ChoiceLogprobs, PromptTokensDetails, TokenLogprob, TopLogprob, Usage

if TYPE_CHECKING:
    from freetoken_agents.model import FreeTokenModel

    from .completions_decode import RawFinished

logger = logging.getLogger(__name__)

__all__ = [
    "ContentDelta",
    "Event",
    "Finished",
    "ReasoningDelta",
    "ToolCallDone",
    "run_completion",
    "total_usage",
    "wire_logprobs",
]


def turn_request(req: PreparedRequest) -> ChatTurnRequest:
    """The chat turn a prepared request asks for: max_tokens bounds the free text, each tool call,
    a JSON reply and a grammar reply alike."""
    return ChatTurnRequest(
        ids=req.ids,
        tools=req.tools if req.tools_on else [],
        force=req.force if req.tools_on else None,
        json_schema=req.json_schema,
        grammar=req.grammar,
        stop=req.stop,
        max_tokens=req.max_tokens,
        max_call_tokens=req.max_tokens,
        json_limit="max_tokens",
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        logprobs=req.logprobs,
        logit_bias=req.logit_bias,
        call_sources=req.call_sources,
    )


def run_completion(
    backend: FreeTokenModel,
    cache: PrefixCache,
    req: PreparedRequest,
    *,
    reuse: bool,
    cancelled: Callable[[], bool] = lambda: False,
    tenant: str = "",
) -> Iterator[Event]:
    """Generate the reply to `req` (see the module docstring). Raises OpenAIError (400) when a
    forced call or a JSON reply cannot close inside max_tokens. Prefix reuse is `tenant`'s own."""
    turn = run_chat_choices(
        backend, cache, turn_request(req), req.n, reuse=reuse, cancelled=cancelled, tenant=tenant
    )
    content: set[int] = set()  # choices some content was sent for: text after calls on a new line
    try:
        for event in turn:
            if isinstance(event, ToolCallDone) and event.error is not None:
                logger.warning("dropping a malformed tool call %r: %s", event.raw[:80], event.error)
                continue
            if isinstance(event, ContentDelta):
                if event.after_calls and event.choice in content:
                    event = dataclasses.replace(event, text="\n" + event.text)
                content.add(event.choice)
            yield event
    except TokenLimitTooSmall as e:  # a forced call or JSON reply whose shortest value does not fit
        raise bad_request(str(e).replace("max_call_tokens", "max_tokens"), param="max_tokens") from e
    finally:
        turn.close()


def wire_logprobs(entries: Sequence[TokenLogprobs]) -> ChoiceLogprobs:
    """Token logprobs as a choice (or a chunk's choice) carries them."""
    return ChoiceLogprobs(
        content=[
            TokenLogprob(
                token=e.token,
                bytes=list(e.bytes),
                logprob=e.logprob,
                top_logprobs=[
                    TopLogprob(token=t.token, bytes=list(t.bytes), logprob=t.logprob) for t in e.top_logprobs
                ],
            )
            for e in entries
        ]
    )


def total_usage(done: Sequence[Finished | RawFinished]) -> Usage:
    """The usage of a request's choices (their `Finished`, or a legacy completion's `RawFinished`):
    the prompt once, the completions summed (as OpenAI counts n > 1)."""
    first = done[0]
    completion = sum(d.completion_tokens for d in done)
    return Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=completion,
        total_tokens=first.prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=first.cached_tokens),
    )
