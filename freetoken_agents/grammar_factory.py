"""The grammars of constrained values, compiled by xgrammar for one tokenizer: JSON values under a
schema (bounded: `schema_bounds`), Qwen3-Coder's XML call bodies, and a reply's text under a
`TextGrammar` (a regex, an EBNF / GBNF grammar, a choice of strings). `GrammarFactory` caches them
per key (`grammar_cache`, LRU), precompiles them on the compile thread with a deadline (the
server's), and turns each into the constraint `constrained.ConstrainedDecode` decodes under.

Properties keep their declared order: a schema sorted with `sort_keys=True` put "arguments"
before "name", an order the model never saw, and it wrote garbage."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ._body_formats import XmlParamsLexer, xml_structural_tag
from .grammar_cache import CompiledGrammar, GrammarCache
from .grounding import (
    SpanGrounding,
    object_keys,
    schema_paths,
    sole_required_strings,
    tool_key_paths,
    tool_texts,
)
from .json_constraint import JsonConstraint, TextConstraint, load_xgrammar
from .parsers.qwen3_coder import xml_parameters
from .schema_bounds import BoundedCompiler, bounded_json_ebnf, string_limit
from .schema_check import check_schema
from .token_vocab import TokenVocab

GRAMMAR_CACHE_SIZE = 128  # compiled schemas kept per tokenizer


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


class GrammarFactory:
    """Compiles the grammars of constrained values for one tokenizer (cached per schema, order
    kept): JSON values (`json_schema`) and Qwen3-Coder's XML parameters (`xml_parameters`).
    Thread-safe. `precompile` compiles one ahead of its use, on a compile thread and with a
    deadline (the server: never on the engine worker that serves every client)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        xgr = load_xgrammar()
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
        return bounded_json_ebnf(schema, load_xgrammar())
