"""FreeTokenModel: the backend protocol (`backend.py`, re-exported here) over the engine.

FreeTokenModel is also the typed seam between the SDK and the engine: the turn decoder
(`_decode.py`), the constrained decoder and the LangChain adapter drive the engine only through
its public methods (prefill, decode, next_logits, truncate, append_pending, restore, pin,
decode_json), never through its session's or its own private state.

Concurrency: a FreeTokenModel is one context (one engine session, its anchors and usage): one
conversation, driven by one caller at a time. `new_context()` opens another over the same engine
(the tokenizer, parser and compiled grammars are shared), as cheap as a new session; the Agent
opens one per run. Contexts over one engine may be used from any threads: each engine step holds
the engine's lock for that step only. Within one context every step holds the context's lock, and
a turn being generated (`generate`, `decode_json`) checks each time it resumes that nobody else
changed the context meanwhile; if someone did, it raises ContextConflict rather than continue
from a context it did not write.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from freetoken_agents.engine import SamplingParams, encode_plain

from ._context_guard import ContextGuard, context_read, context_step
from ._decode import TurnDecoder
from ._structured_decode import decode_structured
from .anchors import AnchorBook, AnchorHandle, RollbackOutcome
from .backend import GenerateRequest, GenEvent, ModelBackend, Usage, common_prefix_length
from .embedded import is_default_model
from .grammar_factory import GrammarFactory, TextGrammar
from .parsers import parser_for, reasoning_markers, with_template_call_ids
from .trace import AnchorKind
from .trained_tools import trained_tools

if TYPE_CHECKING:
    from freetoken_agents.engine import Anchor, Engine, Session


__all__ = ["FreeTokenModel", "GenEvent", "GenerateRequest", "ModelBackend", "Usage", "common_prefix_length"]


@dataclass
class _SharedParts:
    """What the contexts of one FreeTokenModel share: the compiled grammars (made once)."""

    grammars: GrammarFactory | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class FreeTokenModel(ContextGuard):
    """The FreeToken engine as an agent backend: one context (an engine session), native anchors
    when the engine has them (else token-id-validated truncation), xgrammar-constrained tool
    arguments.

    One context, one caller at a time; `new_context()` for another conversation over the same
    engine (see the module docstring: Concurrency). `close()` releases the context's KV and anchors.
    `validate`: how every rollback checks its anchor (passed to `Session.rollback(validate=...)`
    unchanged: the engine's modes, e.g. "signature" or "full"); None uses the engine's default.
    `session` is the engine session holding the context: read it, change it through this class.
    """

    supports_contexts = True
    """`new_context()` opens another context over the same engine (the Agent opens one per run)."""

    def __init__(
        self,
        engine: Engine,
        *,
        family: str | None = None,
        max_anchors: int = 64,
        validate: str | None = None,
        ground_arguments: bool | None = None,
        relevant_calls: bool | None = None,
    ) -> None:
        self.engine = engine
        # The defaults of an Agent's and ChatFreeToken's `ground_arguments` and `relevant_calls`: on
        # for the embedded model, whose figures they lower none of (README, "The embedded model");
        # else off.
        embedded = is_default_model(engine.source)
        self.ground_arguments = embedded if ground_arguments is None else ground_arguments
        self.relevant_calls = embedded if relevant_calls is None else relevant_calls
        # Tools the model was trained to call: relevant calls leave the decision on them to it.
        self.trained_tools = trained_tools(engine.source)
        self.tokenizer = engine.tokenizer
        self.name = f"freetoken:{engine.spec.model_type}"
        self.parser = parser_for(family, chat_template=getattr(self.tokenizer, "chat_template", None))
        # `<think>` blocks go apart from the answer when the template knows them (Qwen3 and the like)
        self.reasoning = reasoning_markers(getattr(self.tokenizer, "chat_template", None))
        self.stop_ids = tuple(engine.default_stop_token_ids())
        self.validate = validate
        self.max_anchors = max_anchors
        self._shared = _SharedParts()
        self._open()

    def _open(self, session: Session | None = None) -> None:
        """This object's own context: session (`session`, else a new one), anchors, usage, lock
        (the rest is shared)."""
        self.anchors = AnchorBook(self.max_anchors, store=self.engine.anchors)
        self.session = session if session is not None else self.engine.new_session()
        self._usage = Usage()
        self._logits: torch.Tensor | None = None  # next-token logits [V] after the context, when known
        self._open_guard()

    @property
    def step_owner(self) -> Engine:
        """The engine: every model and context over it shares one step worker, so the SDK's
        per-token work (tokenizer, grammar masks, sampling) never runs in two threads at once."""
        return self.engine

    def new_context(self) -> FreeTokenModel:
        """Another context over the same engine: an empty session, its own anchors and usage; the
        tokenizer, parser, settings and compiled grammars are shared. Close it (`close()`, or use
        it as a context manager) to release its KV and anchors."""
        twin = copy.copy(self)
        twin._open()
        return twin

    @context_read
    def fork(self) -> FreeTokenModel:
        """Another context holding this one's tokens: the engine session forked (its KV blocks
        shared, copy-on-write: no prefill) and the next-token logits shared; its own anchors (none)
        and usage. n replies to one prompt decode in forks of the context that prefilled it.
        Close it when done."""
        twin = copy.copy(self)
        twin._open(self.session.fork())
        twin._logits = self._logits
        return twin

    @context_step
    def close(self) -> None:
        """Release this context: its anchors leave the engine's store, its KV blocks go back to
        the pool. Idempotent; a closed context raises the engine's EngineError when used."""
        self.anchors.clear()
        self.session.close()
        self._logits = None

    def __enter__(self) -> FreeTokenModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        family: str | None = None,
        max_anchors: int = 64,
        validate: str | None = None,
        ground_arguments: bool | None = None,
        relevant_calls: bool | None = None,
        **engine_options: Any,
    ) -> FreeTokenModel:
        """Load `path` (a checkpoint folder, an .ftw file, or a Hugging Face Hub id
        ``org/name[@revision][:QUANT]``) with `Engine.from_pretrained(path, **engine_options)`
        (device, dtype, memory, placement, ... passed unchanged) and wrap it. `.engine` is the
        loaded engine. `ground_arguments`, `relevant_calls`: the defaults of Agents and ChatFreeToken
        over this model (`Agent(ground_arguments=..., relevant_calls=...)`); None: on for the
        embedded model only."""
        from freetoken_agents.engine import Engine

        engine = Engine.from_pretrained(path, **engine_options)
        return cls(
            engine,
            family=family,
            max_anchors=max_anchors,
            validate=validate,
            ground_arguments=ground_arguments,
            relevant_calls=relevant_calls,
        )

    # ---- context --------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        return self.session.position

    @property
    def token_ids(self) -> list[int]:
        return self.session.token_ids

    @property
    def max_context(self) -> int:
        """The most tokens the context may hold."""
        return self.engine.max_context

    @property
    def vocab_size(self) -> int:
        """Size of the logits vector (the model's vocabulary, padding included)."""
        return self.engine.spec.vocab_size

    def render(
        self,
        messages: Sequence[dict],
        tools: Sequence[dict] | None,
        *,
        generation_prompt: bool = True,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        # call ids in the form every template accepts (Mistral's raise on any other): `call_ids`
        messages = with_template_call_ids(messages)
        return self.engine.apply_chat_template(
            messages, tools, add_generation_prompt=generation_prompt, variables=variables
        )

    @context_step
    def sync(self, ids: Sequence[int]) -> None:
        """Make the context exactly `ids`: keep the common prefix, drop the rest, prefill the tail."""
        ids = list(ids)
        current = self.session.token_ids
        keep = common_prefix_length(current, ids)
        if keep < len(current):
            self.truncate(keep)
        self._usage.reused += min(keep, self.session.cached_tokens)
        if keep < len(ids):
            self.prefill(ids[keep:])

    @context_step
    def append_text(self, text: str) -> None:
        # The text is a failure note quoting tool errors (untrusted): special-token text stays text.
        if text:
            self.prefill(encode_plain(self.tokenizer, text))

    @context_step
    def reset(self) -> None:
        """Start an empty context: forget (and discard) this model's anchors, release the KV."""
        self.anchors.clear()
        self._new_session()

    def usage(self) -> Usage:
        return self._usage.model_copy()

    # ---- model steps (the public seam for decoders) -----------------------------------------------
    @context_step
    def prefill(self, token_ids: Sequence[int]) -> None:
        """Append `token_ids` to the context and run them (one batch); next-token logits are ready."""
        ids = list(token_ids)
        if not ids:
            return
        before = self.session.cached_tokens
        self._logits = self.session.prefill(ids, last_only=True)[-1]
        self._usage.prefilled += self.session.cached_tokens - before

    @context_step
    def decode(self, token_id: int) -> None:
        """Append one sampled token and run it (counted as decoded)."""
        self._logits = self.session.decode(token_id)
        self._usage.decoded += 1

    @context_step
    def append_pending(self, token_id: int) -> None:
        """Append a token without running it yet (the stop token that ends a turn): it runs with
        the next prefill or decode, so ending a turn costs no model step."""
        self.session.append_unprocessed(token_id)
        self._logits = None

    @context_step
    def truncate(self, position: int) -> None:
        """Keep the first `position` tokens of the context (pointer work on the KV cache); anchors
        past it are forgotten."""
        self.session.truncate(position)
        self.anchors.forget_after(position)
        self._logits = None

    @context_read
    def next_logits(self) -> torch.Tensor:
        """Logits [V] for the token after the context (recomputes the last token if unknown)."""
        if self._logits is None:  # the same tokens, the last one run again: not a change
            last = self.session.token_ids[-1]
            self.session.truncate(self.session.position - 1)
            before = self.session.cached_tokens
            self._logits = self.session.prefill([last], last_only=True)[-1]
            self._usage.prefilled += self.session.cached_tokens - before
        assert self._logits is not None
        return self._logits

    # ---- anchors --------------------------------------------------------------------------------
    @context_read
    def anchor(self, kind: AnchorKind, label: str | None = None) -> AnchorHandle:
        return self.anchors.place(self.session, kind, label)

    @context_step
    def rollback(self, anchor: AnchorHandle, *, validate: str | None = None) -> RollbackOutcome:
        """Back to `anchor`, checked by `validate` (default: this model's `validate`). If the check
        fails, rebuild the anchor's prefix by prefill in a fresh session (rebuilt=True)."""
        start = self.session.position
        mode = validate if validate is not None else self.validate
        rebuilt = self.anchors.rollback(self.session, anchor, validate=mode)
        self._logits = None
        if rebuilt:
            self._new_session()
            self.anchors.forget_after(anchor.position)
            self.prefill(list(anchor.prefix))
            self.anchors.rebind(self.session, anchor)  # the rebuilt prefix is the anchored one
        else:
            self._usage.saved_by_rollback += anchor.position
        return RollbackOutcome(start, anchor.position, rebuilt)

    @context_read
    def pin(self, kind: AnchorKind = "manual", label: str | None = None) -> Anchor:
        """An engine anchor of the current context that this model does not hold: the caller owns
        it (a prefix cache) and discards it with `engine.anchors.discard(anchor.id)`."""
        return self.session.anchor(kind, label=label)

    @context_step
    def restore(self, anchor: Anchor, *, validate: str | None = None) -> None:
        """Make the context the state pinned by engine `anchor` (pointer work, no prefill),
        checked by `validate` (default: this model's). Raises the engine's AnchorNotFoundError /
        AnchorValidationError, leaving the context unchanged. This model's own anchors are
        forgotten (they belong to the branch left behind)."""
        mode = validate if validate is not None else self.validate
        if mode is None:
            self.session.rollback(anchor)
        else:
            self.session.rollback(anchor, validate=mode)
        self._logits = None
        self.anchors.forget_after(0)

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, request: GenerateRequest) -> Generator[GenEvent, None, None]:
        """Decode one assistant turn after the context (`_decode.TurnDecoder`): text deltas,
        anchors, then "done". Raises ContextConflict if another caller changes the context while
        the turn is suspended between events."""

        def turn() -> Iterator[GenEvent]:
            yield from TurnDecoder(self, request).run()

        return self._guarded(turn())

    def grammars(self) -> GrammarFactory:
        shared = self._shared
        with shared.lock:
            if shared.grammars is None:
                shared.grammars = GrammarFactory(self.tokenizer, self.vocab_size, self.stop_ids)
            return shared.grammars

    def decode_json(
        self,
        schema: dict[str, Any],
        *,
        max_tokens: int,
        sampling: SamplingParams | None = None,
        end_turn: bool = True,
        limit_name: str = "max_tokens",
    ) -> Iterator[GenEvent]:
        """Decode one JSON value under `schema` after the context: text deltas, then a "done"
        event whose finish_reason is "stop" (always, unless the context itself ran out: "length",
        or the engine's memory limit stopped it: "memory").

        The value closes within `max_tokens` sampled tokens (text the schema forces is prefilled
        and not counted); when even the schema's shortest value needs more, TokenLimitTooSmall
        (naming `limit_name`) is raised before anything is decoded. `sampling`: the engine's
        SamplingParams (temperature, top_k, top_p, min_p, penalties, seed; `logprobs` puts each
        sampled token's logprob on the events, as `generate` does). `end_turn`: append the stop
        token afterwards (pending: it costs no model step). ContextConflict as for `generate`.
        """
        return self._guarded(
            decode_structured(self, schema, max_tokens, sampling or SamplingParams(), end_turn, limit_name)
        )

    def decode_grammar(
        self,
        grammar: TextGrammar,
        *,
        max_tokens: int,
        sampling: SamplingParams | None = None,
        end_turn: bool = True,
    ) -> Iterator[GenEvent]:
        """Decode text under `grammar` (`grammar_factory.TextGrammar`: a regex, an EBNF / GBNF
        grammar, a choice of strings) after the context, with `decode_json`'s events, sampling and
        `end_turn`. The text ends with "stop" where the model ends it and the grammar allows (or
        allows nothing more), else at `max_tokens` sampled tokens with "length", perhaps short of
        the grammar's end (`json_constraint.TextConstraint`: no closing guarantee) and then
        without the end-of-turn token. The compiler's error (RuntimeError, ValueError) when it refuses
        the grammar."""
        return self._guarded(
            decode_structured(self, grammar, max_tokens, sampling or SamplingParams(), end_turn, "max_tokens")
        )

    # ---- internals ------------------------------------------------------------------------------
    def _new_session(self) -> None:
        self.session.close()
        self.session = self.engine.new_session()
        self._logits = None
