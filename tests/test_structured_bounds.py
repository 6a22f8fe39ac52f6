"""Structured output ends (issue 63, item 8): every free string, number, array and object of a JSON
grammar is bounded (`schema_bounds`), so a reply under a schema closes in bounded tokens even
without max_tokens. On the embedded model, {"name": str, "age": int} for "hello" wrote
`"age": 42226666...` to the end of the 2,048-token context (finish_reason "length", the openai
client's `parse` raised LengthFinishReasonError); {"answer": str} wrote its string as long."""

from __future__ import annotations

import functools
import json

import pytest
import xgrammar
from pydantic import BaseModel
from serve_harness import MODEL, running_server

from freetoken_agents import default_model
from freetoken_agents.integrations.langchain import ChatFreeToken
from freetoken_agents.schema_bounds import (
    MAX_INTEGER_DIGITS,
    MAX_STRING_CHARS,
    bounded_json_ebnf,
    string_limit,
)

pytestmark = pytest.mark.usefixtures("one_thread")

HELLO = [{"role": "user", "content": "hello"}]


class Person(BaseModel):
    name: str
    age: int


class Answer(BaseModel):
    answer: str


# One free string at its bound (one character per token at worst), a bounded integer, the keys
# and punctuation: far below the context the unbounded replies ran to.
BOUND = MAX_STRING_CHARS + 64


@pytest.fixture(scope="module")
def client():
    with running_server() as s:
        yield s.client()


def test_parse_without_max_tokens_returns_the_object(client):
    r = client.chat.completions.parse(model=MODEL, messages=HELLO, response_format=Person, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Person)
    assert r.usage.completion_tokens <= BOUND


def test_json_object_mode_ends_without_max_tokens(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris as JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.usage.completion_tokens <= BOUND


@functools.cache
def llm() -> ChatFreeToken:
    # a call budget as large as the context allows: the bounds, not the budget, end the value
    return ChatFreeToken(model=str(default_model()), max_call_tokens=4096)


@pytest.mark.parametrize("method", ["json_schema", "json_mode"])
@pytest.mark.parametrize("schema", [Person, Answer])
def test_chatfreetoken_structured_output_ends_in_bounded_tokens(method, schema):
    out = llm().with_structured_output(schema, method=method, include_raw=True).invoke("hello")
    assert isinstance(out["parsed"], schema), out["parsing_error"]
    raw = out["raw"]
    assert raw.response_metadata["finish_reason"] == "stop"
    assert raw.usage_metadata["output_tokens"] <= BOUND


def _accepts(schema: dict, text: str) -> bool:
    tokenizer_info = xgrammar.TokenizerInfo([chr(c) for c in range(32, 127)])
    compiled = xgrammar.GrammarCompiler(tokenizer_info).compile_grammar(bounded_json_ebnf(schema, xgrammar))
    matcher = xgrammar.GrammarMatcher(compiled)
    return bool(matcher.accept_string(text)) and matcher.is_completed()


def test_the_grammar_bounds_numbers_items_and_declared_strings():
    digits = "9" * MAX_INTEGER_DIGITS
    assert _accepts({"type": "integer"}, digits)
    assert not _accepts({"type": "integer"}, digits + "9")
    assert not _accepts({"type": "number"}, "1.5e" + "1" * 4)
    many = "[" + ", ".join(["1"] * 100) + "]"  # MAX_ITEMS (64) after the first, at most
    assert not _accepts({"type": "array", "items": {"type": "integer"}}, many)
    assert _accepts({"type": "array", "items": {"type": "integer"}, "maxItems": 128}, many)
    # a declared maxLength string: no raw control character (json.loads refuses a raw tab)
    assert not _accepts({"type": "string", "maxLength": 8}, '"a\tb"')
    assert _accepts({"type": "string", "maxLength": 8}, '"a b"')


def test_a_schema_that_asks_for_longer_strings_gets_them():
    assert string_limit({"type": "string"}) == MAX_STRING_CHARS
    assert string_limit({"properties": {"essay": {"type": "string", "maxLength": 4000}}}) == 4000
    assert string_limit({"items": {"type": "string", "minLength": 900}}) == 900
