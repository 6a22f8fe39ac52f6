"""One chat completion on the engine: the shared chat turn (`integrations.chat_turn`: prefix reuse,
the SDK's turn or JSON decoder, stop strings, tool calls parsed by the model's own parser) as the
events the HTTP side turns into a response or SSE chunks.

`run_completion` yields `ContentDelta`s as text is decoded, a `ToolCallDone` as each call's closing
marker is decoded (malformed calls are dropped with a warning), then one `Finished` with the finish
reason and usage. It runs on the engine's step worker; between two events it checks
`cancelled()` and stops (finish_reason "cancelled") when the client left.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from freetoken_agents.errors import TokenLimitTooSmall

from ..chat_turn import (
    ChatTurnRequest,
    ContentDelta,
    Event,
    Finished,
    ReasoningDelta,
    ToolCallDone,
    run_chat_turn,
)
from ..prefix_cache import PrefixCache
from .errors import bad_request
from .prepare import PreparedRequest

if TYPE_CHECKING:
    from freetoken_agents.model import FreeTokenModel

logger = logging.getLogger(__name__)

__all__ = ["ContentDelta", "Event", "Finished", "ReasoningDelta", "ToolCallDone", "run_completion"]


def turn_request(req: PreparedRequest) -> ChatTurnRequest:
    """The chat turn a prepared request asks for: max_tokens bounds the free text, each tool call
    and a JSON reply alike."""
    return ChatTurnRequest(
        ids=req.ids,
        tools=req.tools if req.tools_on else [],
        force=req.force if req.tools_on else None,
        json_schema=req.json_schema,
        stop=req.stop,
        max_tokens=req.max_tokens,
        max_call_tokens=req.max_tokens,
        json_limit="max_tokens",
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
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
    turn = run_chat_turn(backend, cache, turn_request(req), reuse=reuse, cancelled=cancelled, tenant=tenant)
    content = False  # some content was sent: text after the calls goes on a new line
    try:
        for event in turn:
            if isinstance(event, ToolCallDone) and event.error is not None:
                logger.warning("dropping a malformed tool call %r: %s", event.raw[:80], event.error)
                continue
            if isinstance(event, ContentDelta):
                if event.after_calls:
                    event = ContentDelta(("\n" if content else "") + event.text)
                content = True
            yield event
    except TokenLimitTooSmall as e:  # a forced call or JSON reply whose shortest value does not fit
        raise bad_request(str(e).replace("max_call_tokens", "max_tokens"), param="max_tokens") from e
    finally:
        turn.close()
