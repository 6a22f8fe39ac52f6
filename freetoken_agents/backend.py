"""The backend protocol the Agent talks to: what a model must do (render, sync/prefill, generate,
anchor, rollback, usage) and the records it exchanges (GenerateRequest, GenEvent, Usage).

The protocol is narrow on purpose so an OpenAI-compatible server with prefix caching can follow:
there rollback means "resend the kept prefix" and the server's prefix cache absorbs it.
FreeTokenModel (`model.py`) implements it over the engine, ScriptedModel (`testing.py`) for
tests, OpenAICompatibleModel (`openai_compat.py`) over HTTP.

Capabilities are declared, not probed: every member the Agent may use is on the protocol, and an
optional capability a backend lacks has a declared "not supported" value (`max_context` None,
`supports_contexts` False), so the Agent reads what a backend can do instead of guessing from
which attributes it happens to have. `BackendBase` holds those defaults for backends with one
context of their own.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from .anchors import AnchorHandle, RollbackOutcome
from .parsers import ToolCallParser
from .trace import AnchorKind

if TYPE_CHECKING:  # the engine (and torch) load with a backend that samples, not with this module
    from freetoken_agents.engine.runtime.sampling import SamplingParams, TokenLogprob


class Usage(BaseModel):
    """Token work done by a backend (cumulative)."""

    prefilled: int = Field(default=0, description="tokens run through the model in batches")
    decoded: int = Field(default=0, description="tokens sampled and run one at a time")
    reused: int = Field(default=0, description="context tokens kept instead of recomputed on sync")
    saved_by_rollback: int = Field(default=0, description="prefix tokens kept by rollbacks")


class GenerateRequest(BaseModel):
    """One assistant turn. `force`: None (free), '*' (some tool must be called) or a tool name.

    Limits: `max_new_tokens` bounds the turn's free text (tokens sampled outside tool calls);
    `max_call_tokens` bounds the tokens sampled inside each tool call (what the schema forces,
    keys, punctuation and the call's markers, is prefilled and not counted). A call always closes
    its JSON inside that budget (the decoder steers towards closing near the end); a forced call
    whose schema cannot fit raises TokenLimitTooSmall before anything is decoded.

    `prefix` is text the turn starts with (assistant prefill): its tokens go through the same
    streaming checks as sampled ones, so a prefix that opens a code block or a tool call is anchored
    and constrained as if the model had written it. `logit_bias` maps token ids to values added to
    their logits while decoding freely (not inside grammar-constrained arguments).

    `stop`: stop strings for the turn's free text (before its first tool call; never inside a
    call's arguments). Text that may still begin one is held back; when one appears, the text before
    it is delivered and the turn ends ("done", finish_reason "stop"); the tokens decoded stay in the
    context, and no end-of-turn token is appended.

    `argument_sources`: grounded arguments (`grounding.py`): every plain string argument of a
    constrained call is decoded as a span of one of these texts (the user's and the tools'
    messages); None: the grammar alone. JSON call bodies only (Qwen3-Coder's XML bodies ignore it).

    Sampling (`engine.sampling.SamplingParams`, passed down unchanged): temperature, top_p, top_k,
    min_p, repetition_penalty (over the context before the turn and the turn's tokens),
    presence_penalty and frequency_penalty (over the turn's generated tokens), seed. `logprobs`:
    None, or N to get each generated token's logprob (raw model distribution) and its N best
    alternatives on the events (`GenEvent.logprobs`; tokens the grammar or `prefix` forced have none).

    `call_sources`: relevant calls (`relevance.py`): with tool_choice "auto" the model may call only
    the offered tools these texts (the user's messages) are about, or that it was trained to call
    (`FreeTokenModel.trained_tools`); when there is none, the turn answers without a call. None: any
    offered tool. A forced call is never gated.
    """

    model_config = ConfigDict(extra="forbid")

    tools: list[dict[str, Any]] = Field(default_factory=list)
    force: str | None = None
    constrain: bool = True
    max_new_tokens: int = Field(default=256, ge=0)
    max_call_tokens: int = Field(default=192, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    prefix: str = ""
    logit_bias: dict[int, float] = Field(default_factory=dict)
    stop: list[str] = Field(default_factory=list)
    argument_sources: list[str] | None = None
    call_sources: list[str] | None = None

    def sampling(self) -> SamplingParams:
        """The request's sampling settings as the engine takes them."""
        from freetoken_agents.engine.runtime.sampling import SamplingParams

        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            logprobs=self.logprobs,
        )


@dataclass(frozen=True)
class GenEvent:
    """A generation event: text delta, reasoning delta (a thinking model's `<think>` block, not
    part of the answer), an anchor placed mid-turn, or the end of the turn.

    finish_reason (on "done"): "stop" (the turn ended), "length" (a token limit or the context's
    end), or "memory" (the engine's memory limit stopped it; every token produced was delivered).
    logprobs (`GenerateRequest.logprobs`): the sampled tokens decoded since the previous event
    that carried some, in order (a token's entry may come before the event with its text, which
    can be held back).
    """

    kind: Literal["text", "reasoning", "anchor", "done"]
    text: str = ""
    anchor: AnchorHandle | None = None
    finish_reason: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


@runtime_checkable
class ModelBackend(Protocol):
    """What an Agent needs from a model.

    `rollback(anchor, validate=...)`: `validate` names how the backend checks the anchor's state
    before returning to it (the engine's modes; None: the backend's own default). The Agent passes
    it only when it was set, so a backend without validation modes may leave it out.

    `generate` returns a generator: the Agent closes it when it stops reading (a failed step, a
    cancelled run), so a backend can release what the turn holds (a lock, an HTTP stream).

    Declared capabilities (`BackendBase` has the defaults of a backend with one context):

    - `max_context`: the most tokens a context may hold; None when the backend cannot know (a
      remote server). The Agent sizes the tool results the model reads from it.
    - `step_owner`: the object whose one worker thread (`sync_bridge.step_worker`) runs this
      backend's steps. Backends over one engine name the engine, so their steps never run in two
      threads at once; a backend that shares nothing names itself.
    - `supports_contexts`: whether `new_context()` opens another context over the same model (its
      own conversation, anchors and usage), released by `close()`. An Agent gives each run its own
      when True; when False runs take turns on the backend's one context, `new_context()` raises
      NotImplementedError and `close()` does nothing.
    - `ground_arguments`: the default of `Agent(ground_arguments=...)` over this backend (grounded
      tool-call arguments, `GenerateRequest.argument_sources`); False unless the model needs it.
    - `relevant_calls`: the default of `Agent(relevant_calls=...)` over this backend (calls gated by
      relevance, `GenerateRequest.call_sources`); False unless the model needs it.
    """

    name: str
    parser: ToolCallParser

    @property
    def position(self) -> int: ...
    @property
    def max_context(self) -> int | None: ...
    @property
    def step_owner(self) -> object: ...
    @property
    def supports_contexts(self) -> bool: ...
    @property
    def ground_arguments(self) -> bool: ...
    @property
    def relevant_calls(self) -> bool: ...
    def render(
        self, messages: Sequence[dict], tools: Sequence[dict] | None, *, generation_prompt: bool = True
    ) -> list[int]: ...
    def sync(self, ids: Sequence[int]) -> None: ...
    def append_text(self, text: str) -> None: ...
    def generate(self, request: GenerateRequest) -> Generator[GenEvent, None, None]: ...
    def anchor(self, kind: AnchorKind, label: str | None = None) -> AnchorHandle: ...
    def rollback(self, anchor: AnchorHandle) -> RollbackOutcome: ...
    def usage(self) -> Usage: ...
    def reset(self) -> None: ...
    def new_context(self) -> ModelBackend: ...
    def close(self) -> None: ...


class BackendBase:
    """The declared defaults of a backend with one context of its own and no known context size
    (ScriptedModel, OpenAICompatibleModel): it cannot open contexts, so an Agent's runs take turns
    on it, and its steps run on a worker thread of its own."""

    supports_contexts: bool = False
    ground_arguments: bool = False  # its model copies arguments well enough without grounding
    relevant_calls: bool = False  # its model judges which tool a request is about

    @property
    def max_context(self) -> int | None:
        """Unknown: the Agent falls back to its default tool-result size."""
        return None

    @property
    def step_owner(self) -> object:
        """This backend shares no model with another, so it owns its step worker."""
        return self

    def new_context(self) -> ModelBackend:
        """Not supported (`supports_contexts` is False): there is one context, this one."""
        raise NotImplementedError(f"{type(self).__name__} has one context: it cannot open another")

    def close(self) -> None:
        """Nothing to release: the one context lives as long as the backend."""


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items `a` and `b` share: what a sync to `b` keeps of a context `a`."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
