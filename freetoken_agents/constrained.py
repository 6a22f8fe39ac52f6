"""Grammar-constrained decoding of JSON values (and of Qwen3-Coder's XML call bodies, whose
values are JSON or raw text: `GrammarFactory.xml_parameters`): the one path every constrained
output takes.

Tool-call arguments in an Agent turn, ChatFreeToken's forced calls and `with_structured_output`,
and (later) the OpenAI-compatible server all decode through `ConstrainedDecode`:

- the grammar comes from a `GrammarFactory` (xgrammar), compiled from the schema as given:
  properties keep their declared order (a schema sorted with `sort_keys=True` put "arguments"
  before "name", an order the model never saw, and it wrote garbage);
- special and added tokens (`<|im_start|>`, `<tool_call>`, ...) are masked out: inside a JSON
  string the grammar alone would accept them as literal text;
- forced stretches (keys, punctuation) are jump-forwarded: prefilled in one batch, not decoded;
- the value always closes inside its budget of sampled tokens (forced text is the schema's, not
  the model's, and costs no decode step, so it does not count): near the end of the budget every
  sampled token is checked against the cost of closing from there (simulated on a fork of the
  matcher), and a token that would leave too little is replaced by a closing one (a string's
  quote, a bracket). A budget below the schema's smallest completion is the caller's error
  (TokenLimitTooSmall).

Why xgrammar: maintained (MLC), CPU bitmask kernels (~20 us/token at a small vocab), JSON-schema
compile in ~1.5 ms, jump-forward tokens and matcher forks. outlines-core has no jump-forward API.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from pydantic import BaseModel

from freetoken_agents.engine.runtime.generate import Sampler

from ._body_formats import JsonLexer, XmlParamsLexer, xml_structural_tag
from .detokenize import IncrementalDetokenizer
from .grammar_cache import CompiledGrammar, GrammarCache
from .grounding import (
    SpanGrounding,
    object_keys,
    schema_paths,
    sole_required_strings,
    tool_key_paths,
    tool_texts,
)
from .parsers.qwen3_coder import xml_parameters
from .schema_bounds import BoundedCompiler, bounded_json_ebnf, string_limit
from .schema_check import check_schema
from .token_vocab import TokenVocab

logger = logging.getLogger(__name__)

ToolChoice = Literal["auto", "none", "required"] | str
"""'auto': the model decides (calls it starts are constrained); 'none': no tools; 'required':
some tool must be called; any other string: that tool must be called."""

CLOSING_SLACK = 8
"""Start checking each sampled token against the closing cost this many tokens before the
budget could run out (one token seldom adds more than this to the cost of closing)."""

GRAMMAR_CACHE_SIZE = 128  # compiled schemas kept per tokenizer
_SIMULATION_LIMIT = 256  # steps a closing-cost simulation may take before it counts as "too many"


class NamedToolChoice(BaseModel):
    name: str


@dataclass(frozen=True)
class TextGrammar:
    """A grammar over a reply's whole text, not a JSON value's: `kind` "regex" (the text matches
    `source`, xgrammar's regex dialect: no lookaround, no backreferences) or "ebnf" (xgrammar's
    EBNF, which reads llama.cpp's GBNF: a `root` rule). `choice` builds the one for "exactly one
    of these strings" (vLLM's guided_choice)."""

    kind: Literal["regex", "ebnf"]
    source: str

    @classmethod
    def choice(cls, options: Sequence[str]) -> TextGrammar:
        """Exactly one of `options`: an EBNF alternation of their literals."""
        return cls("ebnf", "root ::= " + " | ".join(map(_ebnf_literal, options)))

    @property
    def key(self) -> str:
        """Its grammar cache key (a JSON schema's key is its JSON text: no prefix collides)."""
        return f"{self.kind}:{self.source}"


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal: quote and backslash escaped, and every character that is
    not printable written as a code-point escape (a raw newline or control byte would end or
    break the literal)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "constrained decoding needs xgrammar: pip install --no-deps xgrammar==0.2.9 (CPU), "
            "or pip install 'freetoken-agents[cuda]' on an NVIDIA machine"
        ) from e
    return xgrammar


class GrammarFactory:
    """Compiles the grammars of constrained values for one tokenizer (cached per schema, order
    kept): JSON values (`json_schema`) and Qwen3-Coder's XML parameters (`xml_parameters`).
    Thread-safe. `precompile` compiles one ahead of its use, on a compile thread and with a
    deadline (the server: never on the engine worker that serves every client)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        xgr = _xgrammar()
        # The model's vocab size, not the tokenizer's: padded logits must be masked too.
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        # xgrammar's own cache keeps every schema it ever compiled (no limit by default): a server
        # sees schemas without end, so only `_cache`, bounded, keeps them
        # JSON schemas compile bounded (`schema_bounds`): a structured reply ends even when the
        # model runs on
        self.compiler = BoundedCompiler(xgr.GrammarCompiler(self.info, cache_enabled=False), xgr)
        self.vocab_size = vocab_size
        self.vocab = TokenVocab(self.info, tokenizer, vocab_size, stop_token_ids)
        self._cache = GrammarCache(GRAMMAR_CACHE_SIZE)

    def json_schema(
        self,
        schema: dict[str, Any],
        sources: Sequence[str] | None = None,
        tools: Sequence[dict[str, Any]] = (),
    ) -> JsonConstraint:
        """The constraint for `schema`; SchemaRejected (before compiling) when `check_schema`
        refuses it: too costly to compile, or without a finite value. `sources`: ground the value's
        plain string and number fields in these texts, and its string enums in the values they mention
        (`grounding.SpanGrounding`); None: the grammar alone. `tools`: the tools whose calls the
        schema describes (their names and descriptions: no value starts on a tool's own words)."""
        check_schema(schema)  # linear, no recursion: before json.dumps meets a 10,000-deep schema
        compiled = self._cache.get(*self._json_job(schema))
        grounding = None
        if sources is not None:
            paths = schema_paths(schema)
            grounding = SpanGrounding(
                self.vocab.span_index,
                sources,
                paths.strings,
                paths.numbers,
                enum_paths=paths.enums,
                boolean_paths=paths.booleans,
                integer_paths=paths.integers,
                tool_paths=tool_key_paths(schema),
                sole_required=sole_required_strings(schema),
                objects=object_keys(schema),
                tool_texts=tool_texts(tools),
            )
        return JsonConstraint(compiled, self.vocab, grounding=grounding, string_limit=string_limit(schema))

    def xml_parameters(self, schema: dict[str, Any]) -> JsonConstraint:
        """The constraint for the body of a Qwen3-Coder call to a tool whose parameters are
        `schema`: its parameters in the schema's order, required ones present, each written
        `<parameter=P>\\n` VALUE `\\n</parameter>\\n`, then `</function>`. A value is raw text
        (without `</parameter>`) where the parameter may be a string, else JSON under its schema,
        compact as in `json_schema` (`qwen3_coder.xml_parameters` says which). SchemaRejected as
        for `json_schema`."""
        check_schema(schema)
        params = xml_parameters(schema)
        compiled = self._cache.get(*self._xml_job(schema, params))
        raw = frozenset(p.name.encode() for p in params if p.raw)
        required = tuple(p.name.encode() for p in params if p.required)
        return JsonConstraint(
            compiled, self.vocab, XmlParamsLexer(raw, required), string_limit=string_limit(schema)
        )

    def text_grammar(self, grammar: TextGrammar) -> TextConstraint:
        """The constraint for a reply's text under `grammar` (cached by its key); the compiler's
        own error (RuntimeError, ValueError) when it refuses the regex or grammar."""
        return TextConstraint(self._cache.get(*self._text_job(grammar)), self.vocab)

    def precompile_text(self, grammar: TextGrammar, *, timeout: float) -> CompiledGrammar:
        """`precompile` for a `TextGrammar`: compiled now on the compile thread, with the same
        deadlines and errors (SchemaRejected when it did not compile in time)."""
        key, compile = self._text_job(grammar)
        return CompiledGrammar(key, self._cache.get(key, compile, timeout))

    def precompile(
        self, schema: dict[str, Any], *, body_format: str = "json", timeout: float
    ) -> CompiledGrammar:
        """Compile the grammar that `json_schema` (body_format "json") or `xml_parameters`
        ("xml_parameters") will use for `schema`, now, on the compile thread, waiting at most
        `timeout` s for the thread and `timeout` s for the compile (`GrammarCache.get`); the
        handle `keep` puts back in the cache. SchemaRejected when `check_schema` refuses the
        schema or it did not compile in time; GrammarCompilerBusy when other compiles held the
        thread; the compiler's own error (RuntimeError, ValueError) when it refuses the schema."""
        check_schema(schema)
        if body_format == "xml_parameters":
            key, compile = self._xml_job(schema, xml_parameters(schema))
        else:
            key, compile = self._json_job(schema)
        return CompiledGrammar(key, self._cache.get(key, compile, timeout))

    def keep(self, *grammars: CompiledGrammar) -> None:
        """Put precompiled grammars back in the cache, as the most recently used."""
        self._cache.keep(*grammars)

    def _json_job(self, schema: dict[str, Any]) -> tuple[str, Callable[[], Any]]:
        # Property order is part of the grammar (xgrammar emits properties in schema order), so
        # the schema is neither sorted for compiling nor for the cache key.
        key = json.dumps(schema)
        return key, lambda: self.compiler.compile_json_schema(key, any_whitespace=False, strict_mode=True)

    def _text_job(self, grammar: TextGrammar) -> tuple[str, Callable[[], Any]]:
        if grammar.kind == "regex":
            return grammar.key, lambda: self.compiler.compile_regex(grammar.source)
        return grammar.key, lambda: self.compiler.compile_grammar(grammar.source)

    def _xml_job(self, schema: dict[str, Any], params: Any) -> tuple[str, Callable[[], Any]]:
        def compile() -> Any:
            tag = xml_structural_tag(params, self._json_ebnf)  # converts each value's schema
            return self.compiler.compile_structural_tag(json.dumps(tag))

        return "xml_parameters:" + json.dumps(schema), compile

    @staticmethod
    def _json_ebnf(schema: dict[str, Any]) -> str:
        """The grammar of one JSON value under `schema` (compact and bounded, as `json_schema`
        compiles it)."""
        return bounded_json_ebnf(schema, _xgrammar())


class JsonConstraint:
    """One value under a compiled grammar: mask logits, accept tokens, jump forward, and the cost
    (in tokens) of closing the value from the current state. `lexer` tells the closing policy
    where the value stands (`_body_formats`): a JSON value's by default. `grounding` further masks
    the tokens of plain string fields to spans of the conversation (None: the grammar alone).
    `string_limit`: the characters a string may run to before the decoder closes it
    (`schema_bounds.string_limit`; None: no limit)."""

    def __init__(
        self,
        compiled: Any,
        vocab: TokenVocab,
        lexer: JsonLexer | XmlParamsLexer | None = None,
        grounding: SpanGrounding | None = None,
        string_limit: int | None = None,
    ) -> None:
        xgr = _xgrammar()
        self._xgr = xgr
        self.vocab = vocab
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab.size)
        self.lexer = lexer if lexer is not None else JsonLexer()
        self.grounding = grounding
        self.string_limit = string_limit

    # ---- state -----------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        """The text so far is a complete value (more may still be allowed: digits of a number)."""
        return self.matcher.is_completed()

    @property
    def finished(self) -> bool:
        """Complete and closed: nothing but the end may follow."""
        return self.complete and self.lexer.closed

    @property
    def string_ran_long(self) -> bool:
        """The open string has reached `string_limit` characters: it must close now."""
        return self.string_limit is not None and self.lexer.string_chars >= self.string_limit

    # ---- steps -----------------------------------------------------------------------------------
    def mask_(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the logits [V] of tokens the grammar forbids, and of special tokens, to -inf."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        view = logits.view(1, -1) if logits.dim() == 1 else logits
        self._xgr.apply_token_bitmask_inplace(view, self.bitmask.to(logits.device))
        flat = logits.view(-1)
        flat[: self.vocab.size].masked_fill_(
            self.vocab.banned_on(logits.device)[: flat.numel()], float("-inf")
        )
        if self.grounding is not None:
            self.grounding.restrict_(logits)
        return logits

    def restrict_to_closing_(self, logits: torch.Tensor) -> torch.Tensor:
        """Keep only (already masked) logits [V] of tokens on a short way to closing the value:
        the closers of an open string or of brackets when any is allowed, else the allowed tokens
        that progress most (`_progress`)."""
        flat = logits.view(-1)
        allowed = torch.isfinite(flat)
        keep = torch.zeros_like(allowed)
        for closers in self.lexer.closers(self.vocab):
            keep = allowed & torch.isfinite(closers.to(flat.device)[: flat.numel()])
            if bool(keep.any()):
                break
        if not bool(keep.any()):
            scores = self.vocab.progress.to(flat.device)[: flat.numel()].masked_fill(~allowed, float("-inf"))
            keep = allowed & (scores == scores.max())
        stop = torch.zeros_like(allowed)
        for i in self.vocab.stop_ids:
            if i < flat.numel():
                stop[i] = bool(allowed[i])  # a complete number may end here
        flat.masked_fill_(~(keep | stop), float("-inf"))
        return logits

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            raise RuntimeError(f"grammar rejected token {token_id} it allowed")
        self.lexer.feed(self.vocab.pieces[token_id])
        if self.grounding is not None:
            self.grounding.feed(self.vocab.pieces[token_id])

    def jump_forward(self) -> list[int]:
        """Tokens the grammar allows no alternative to from here (may be empty); not accepted yet."""
        return _up_to_banned(self.matcher.find_jump_forward_tokens(), self.vocab.banned_ids)

    def forced_text(self) -> str:
        """Text the grammar allows no alternative to from here (may be empty)."""
        return self.matcher.find_jump_forward_string()

    def closing_cost(self, after: int | None = None) -> int:
        """Sampled tokens needed to finish the value from here (after accepting `after`, if
        given), following the closing policy: jump-forwards (free), then the best-closing allowed
        token. The state is untouched (the walk runs on a fork of the matcher)."""
        matcher, lexer = self.matcher.fork(), self.lexer.copy()
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab.size)
        cost = 0
        if after is not None:
            if not matcher.accept_token(after):
                return _SIMULATION_LIMIT
            lexer.feed(self.vocab.pieces[after])
        for _ in range(_SIMULATION_LIMIT):
            if matcher.is_completed() and (lexer.closed or self._stop_allowed(matcher, bitmask)):
                return cost
            forced = _up_to_banned(matcher.find_jump_forward_tokens(), self.vocab.banned_ids)
            steps = forced or [self._closing_choice(matcher, lexer, bitmask)]
            for t in steps:
                if t < 0 or not matcher.accept_token(t):
                    return _SIMULATION_LIMIT
                lexer.feed(self.vocab.pieces[t])
            cost += 0 if forced else 1
        return _SIMULATION_LIMIT

    def closing_choice(self) -> int:
        """The closing policy's next token from here (the first step `closing_cost` counts)."""
        return self._closing_choice(self.matcher, self.lexer, self.bitmask)

    # ---- internals -------------------------------------------------------------------------------
    def _stop_allowed(self, matcher: Any, bitmask: torch.Tensor) -> bool:
        matcher.fill_next_token_bitmask(bitmask)
        return any(self._allowed(bitmask, i) for i in self.vocab.stop_ids)

    @staticmethod
    def _allowed(bitmask: torch.Tensor, token_id: int) -> bool:
        return bool((int(bitmask[0, token_id // 32]) >> (token_id % 32)) & 1)

    def _closing_choice(self, matcher: Any, lexer: JsonLexer | XmlParamsLexer, bitmask: torch.Tensor) -> int:
        """The closing policy's token (no logits: by preference score), or -1 when stuck."""
        matcher.fill_next_token_bitmask(bitmask)
        for table in (*lexer.closers(self.vocab), self.vocab.progress):
            scores = table.clone().view(1, -1)
            self._xgr.apply_token_bitmask_inplace(scores, bitmask)
            best = int(torch.argmax(scores))
            if torch.isfinite(scores[0, best]):
                return best
        return -1


class TextConstraint(JsonConstraint):
    """A reply's text under a `TextGrammar` (a regex, an EBNF/GBNF grammar, a choice). The JSON
    closing policy (close the open string, then the brackets) means nothing here, and the shortest
    way to a grammar's end is not known without searching it: so no closing guarantee. The text
    ends where the model ends it and the grammar allows (or allows nothing more), else at its
    budget, finish_reason "length" and possibly mid-pattern, as vLLM's and llama-server's
    grammar outputs do."""

    @property
    def finished(self) -> bool:
        return False  # only the stop token ends it: the grammar allows it once the text is complete

    def closing_cost(self, after: int | None = None) -> int:
        return 0  # nothing to steer towards: `ConstrainedDecode` never forces a closing token


def _up_to_banned(tokens: list[int], banned: frozenset[int]) -> list[int]:
    """`tokens` up to the first banned one (the grammar's literal text is then sampled instead)."""
    for i, t in enumerate(tokens):
        if t in banned:
            return tokens[:i]
    return tokens


class TokenStepper(Protocol):
    """What ConstrainedDecode needs of a model: the next-token logits and a way to append tokens."""

    def next_logits(self) -> torch.Tensor: ...
    def decode(self, token_id: int) -> None: ...
    def prefill(self, token_ids: Sequence[int]) -> None: ...


class ConstrainedDecode:
    """Decode one JSON value under `constraint` on `model`, sampling at most `budget` tokens
    (jump-forwarded text does not count) and appending at most `room` tokens in all (the
    context's limit; None: no limit). Iterate it for text deltas; afterwards `finish_reason` is
    "stop" (the value is complete) or "length" (a limit ran out first: only when `budget` is
    below `min_tokens`, or `room` is too small), and `token_ids` holds what was appended.

    The stop token is never appended: ending the turn is the caller's business.
    """

    def __init__(
        self,
        model: TokenStepper,
        constraint: JsonConstraint,
        *,
        budget: int,
        sampler: Sampler,
        tokenizer: Any,
        room: int | None = None,
    ) -> None:
        self.model, self.constraint, self.budget, self.sampler = model, constraint, budget, sampler
        self.room = room
        self.detok = IncrementalDetokenizer(tokenizer)
        self.min_tokens = constraint.closing_cost()
        self.sampled = 0
        self.finish_reason: Literal["stop", "length"] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.detok.ids

    @property
    def text(self) -> str:
        return self.detok.text

    def __iter__(self) -> Iterator[str]:
        c, stops = self.constraint, self.constraint.vocab.stop_ids
        room = self.room if self.room is not None else float("inf")
        need = self.min_tokens
        self.finish_reason = "length"
        while True:
            if c.finished:
                self.finish_reason = "stop"
                break
            if len(self.detok) >= room:
                break
            forced = c.jump_forward()  # free: it costs no sampled token
            if forced:
                forced = forced[: int(min(len(forced), room - len(self.detok)))]
                for t in forced:
                    c.accept(t)
                self.model.prefill(forced)
                yield self.detok.extend(forced)
                continue
            remaining = self.budget - self.sampled
            if remaining <= 0:
                break
            logits = c.mask_(self.model.next_logits().clone())
            if c.string_ran_long:  # a free string at its bound (`schema_bounds`): close it now
                logits = c.restrict_to_closing_(logits)
            token = self.sampler(logits)
            if remaining <= need + CLOSING_SLACK and token not in stops:
                need = c.closing_cost(after=token)
                if 1 + need > remaining:  # this token would leave too little: close instead,
                    token = self.sampler(c.restrict_to_closing_(logits))  # the model's way,
                    need = c.closing_cost(after=token) if token not in stops else 0
                    if 1 + need > remaining:  # or the policy's, which costs what was planned
                        token = c.closing_choice()
                        need = c.closing_cost(after=token)
            if token in stops:  # allowed only once the value is complete (a number's end)
                self.finish_reason = "stop"
                break
            c.accept(token)
            self.model.decode(token)
            self.sampled += 1
            yield self.detok.push(token)
        yield self.detok.flush()


def resolve_tool_choice(choice: ToolChoice, tool_names: list[str]) -> str | None:
    """None when no call is forced; '*' for any tool; else the forced tool's name."""
    if choice in ("auto", "none"):
        return None
    if choice == "required":
        return "*"
    if choice not in tool_names:
        raise ValueError(f"tool_choice {choice!r} is not one of the agent's tools {tool_names}")
    return choice
