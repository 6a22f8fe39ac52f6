"""One value decoded after a model's context under a JSON schema or a `TextGrammar`: the loop
behind FreeTokenModel's `decode_json` and `decode_grammar` (`model.py`, which documents them) on
the one constrained decoder (`constrained.ConstrainedDecode`), the sampler's penalties and the
logprobs recorded as a turn's are (`_turn_output`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from freetoken_agents.engine import MemoryBudgetError, SamplingParams
from freetoken_agents.engine.runtime.sampling import Sampler

from ._turn_output import RecordingStepper, TurnOutput
from ._turn_text import TurnModel
from .backend import GenEvent
from .constrained import ConstrainedDecode
from .errors import TokenLimitTooSmall
from .grammar_factory import TextGrammar

logger = logging.getLogger("freetoken_agents.model")  # FreeTokenModel's, whose methods these are


def decode_structured(
    model: TurnModel,
    schema: dict[str, Any] | TextGrammar,
    max_tokens: int,
    sampling: SamplingParams,
    end_turn: bool,
    limit_name: str,
) -> Iterator[GenEvent]:
    """`decode_json` (`schema` a JSON schema) or `decode_grammar` (a TextGrammar) on `model`,
    unguarded (the caller holds the context's guard)."""
    sampler = Sampler(sampling, model.token_ids if sampling.repetition_penalty != 1.0 else ())
    output = TurnOutput(model, sampler, sampling.logprobs)
    call = ConstrainedDecode(
        RecordingStepper(model, output) if output.records else model,
        model.grammars().text_grammar(schema)
        if isinstance(schema, TextGrammar)
        else model.grammars().json_schema(schema),
        budget=max_tokens,
        room=model.max_context - model.position - (1 if end_turn else 0),
        sampler=sampler,
        tokenizer=model.tokenizer,
    )
    if call.min_tokens > max_tokens:
        raise TokenLimitTooSmall(
            f"{limit_name}={max_tokens} is too small for this schema: its shortest JSON value "
            f"takes {call.min_tokens} sampled tokens",
            limit=limit_name,
            value=max_tokens,
            needed=call.min_tokens,
        )
    try:
        for delta in call:
            if delta:
                yield GenEvent("text", delta, logprobs=output.take())
    except MemoryBudgetError as e:  # what was decoded has been delivered
        logger.warning("structured output stopped by the memory limit: %s", e)
        yield GenEvent("done", finish_reason="memory", logprobs=output.take())
        return
    # a grammar's text cut by its budget did not end: no end of turn (as free text), so its
    # completion counts max_tokens tokens, not one more
    ended = call.finish_reason == "stop" or not isinstance(schema, TextGrammar)
    if end_turn and ended and model.stop_ids:
        model.append_pending(model.stop_ids[0])
    yield GenEvent("done", finish_reason=call.finish_reason, logprobs=output.take())
