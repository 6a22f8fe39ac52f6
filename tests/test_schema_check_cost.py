"""What one compile may cost, bounded before the grammar compiler sees the schema (issue 59, item
2): a `pattern`'s repetitions (`regex_cost`), formats and number ranges, and the literal text of
enums, consts and property names. A refusal is a `SchemaRejected` naming where and which limit;
ordinary patterns pass."""

from __future__ import annotations

import pytest

from freetoken_agents import SchemaRejected
from freetoken_agents.regex_cost import PatternTooCostly, pattern_states
from freetoken_agents.schema_check import (
    FORMAT_COST,
    MAX_GRAMMAR_COST,
    MAX_LITERAL_CHARS,
    MAX_PATTERN_LENGTH,
    MAX_PATTERN_STATES,
    check_schema,
)

ORDINARY = [
    r"^[a-z]{2,3}$",
    r"^\d{4}-\d{2}-\d{2}$",
    r"^[a-z0-9._%+-]{1,64}@[a-z0-9.-]{1,255}\.[a-z]{2,63}$",  # email, with RFC lengths
    r"^[^@\s]+@[^@\s]+\.[^@\s]+$",
    r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",  # a UUID
    r"^\+?[1-9]\d{1,14}$",  # E.164 phone number
    r"^(?:[01]\d|2[0-3]):[0-5]\d$",
    r"^(?<year>\d{4})-(?P<month>\d{2})$",
    r"^[A-Z][a-z]*(?: [A-Z][a-z]*)*$",
]


@pytest.mark.parametrize("pattern", ORDINARY)
def test_ordinary_patterns_are_accepted(pattern):
    assert 0 < pattern_states(pattern, MAX_PATTERN_STATES) <= MAX_PATTERN_STATES
    check_schema({"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}})


@pytest.mark.parametrize(
    "pattern",
    [
        "^(a|b){1,20000}$",  # the issue's: more than 90 s to compile
        "^a{1,9999}$",  # 15 s
        "^((a|b){1,30}){1,30}$",  # nesting multiplies: 1,800
        "^(?:x{50}){50}$",  # so does a non-capturing group: 2,500
        "^a{" + "9" * 5_001 + "}$",  # a bound Python would refuse to turn into an int
        "^a{600,}$",  # an open bound: its minimum, then a loop
    ],
)
def test_costly_repetitions_are_refused(pattern):
    with pytest.raises(PatternTooCostly) as caught:
        pattern_states(pattern, MAX_PATTERN_STATES)
    assert caught.value.states > MAX_PATTERN_STATES and caught.value.limit == MAX_PATTERN_STATES


@pytest.mark.parametrize(
    ("pattern", "states"),
    [
        ("abc", 3),
        ("a{3}", 3),
        ("a{2,5}", 5),
        ("a{2,}", 3),
        ("a+", 2),
        ("a*b?", 2),
        ("(ab|c){4}", 12),
        ("((a){2}){3}", 6),
        ("[a-z]{10}", 10),
        ("[]{}]{10}", 10),  # `]` and braces inside a class are members, not syntax
        (r"\{{10}", 10),  # an escaped brace, then its quantifier
        ("a{,5}", 5),  # not a quantifier in ECMAScript: five characters
        ("a{2}?b{3}+", 5),  # lazy and possessive markers repeat nothing
        ("(?:a|b)(?=c)(?!d)", 4),
        ("((a)", 1),  # unclosed: counted as closed
    ],
)
def test_the_estimate_counts_the_copies_the_compiler_makes(pattern, states):
    assert pattern_states(pattern, 10_000) == states


def test_the_issues_tool_schema_is_refused_naming_the_regex_and_the_limit():
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^(a|b){1,20000}$"}},
        "required": ["code"],
    }
    with pytest.raises(SchemaRejected) as caught:
        check_schema(schema)
    message = str(caught.value)
    assert "properties.code.pattern" in message and str(MAX_PATTERN_STATES) in message
    assert "\n" not in message


def test_pattern_properties_and_nested_patterns_are_checked_too():
    with pytest.raises(SchemaRejected, match=r"patternProperties\.\^a\{1,9999\}\$"):
        check_schema({"type": "object", "patternProperties": {"^a{1,9999}$": {"type": "integer"}}})
    deep = {"type": "array", "items": {"anyOf": [{"type": "string", "pattern": "x{1000}"}]}}
    with pytest.raises(SchemaRejected, match=r"items\.anyOf\.0\.pattern"):
        check_schema(deep)


def test_a_property_named_like_a_keyword_is_still_a_schema():
    # the walk used to treat any "enum" key as a literal: a property named "enum" hid its pattern
    schema = {"type": "object", "properties": {"enum": {"type": "string", "pattern": "^a{1,9999}$"}}}
    with pytest.raises(SchemaRejected, match=r"properties\.enum\.pattern"):
        check_schema(schema)
    # and a default or an example is data, never compiled: its "pattern" key is not a regex
    check_schema({"type": "object", "default": {"pattern": "^a{1,9999}$"}, "examples": [{"enum": 1}]})


def test_a_long_pattern_is_refused():
    with pytest.raises(SchemaRejected, match=f"at most {MAX_PATTERN_LENGTH}"):
        check_schema({"type": "string", "pattern": "a" * (MAX_PATTERN_LENGTH + 1)})


def test_many_affordable_patterns_are_refused_together():
    one = {"type": "string", "pattern": "^(a|b){1,249}$"}  # 500 states: allowed alone
    fits = MAX_GRAMMAR_COST // 500
    check_schema({"type": "object", "properties": {f"p{i}": one for i in range(fits)}})
    with pytest.raises(SchemaRejected, match=f"more than {MAX_GRAMMAR_COST} units"):
        check_schema({"type": "object", "properties": {f"p{i}": one for i in range(fits + 1)}})


def test_formats_and_number_ranges_count_towards_the_compile_cost():
    fmt = {"type": "string", "format": "uri"}
    many = MAX_GRAMMAR_COST // FORMAT_COST + 1
    nested = {"type": "array", "items": {"anyOf": [fmt] * many}}  # under the 256-properties limit
    with pytest.raises(SchemaRejected, match="formats and number ranges"):
        check_schema(nested)
    huge = {"type": "number", "minimum": -1e300, "maximum": 1e300}  # 54 ms each to compile
    check_schema({"type": "array", "items": {"anyOf": [huge] * 10}})
    with pytest.raises(SchemaRejected, match="formats and number ranges"):
        check_schema({"type": "array", "items": {"anyOf": [huge] * 20}})
    with pytest.raises(SchemaRejected, match="not a finite number"):
        check_schema({"type": "number", "maximum": float("inf")})  # json.loads reads 1e999 so
    # an integer bound far past what str() converts (4,300 digits) is counted, not converted
    check_schema({"type": "integer", "maximum": 10**5_000 - 1})


def test_literal_text_is_bounded():
    check_schema({"type": "string", "const": "x" * MAX_LITERAL_CHARS})
    with pytest.raises(SchemaRejected, match=f"more than {MAX_LITERAL_CHARS} characters"):
        check_schema({"type": "string", "const": "x" * (MAX_LITERAL_CHARS + 1)})
    with pytest.raises(SchemaRejected, match="characters"):
        check_schema({"enum": ["y" * 1_000 + str(i) for i in range(20)]})
    names = {"k" * 40 + str(i): {"type": "integer"} for i in range(250)}  # 2 x 10,000 characters
    with pytest.raises(SchemaRejected, match="property names"):
        check_schema({"type": "object", "properties": names})


def test_a_factory_refuses_the_issues_pattern_before_compiling():
    pytest.importorskip("xgrammar")
    from tiny_models import make_tiny_tokenizer

    from freetoken_agents.constrained import GrammarFactory

    tok = make_tiny_tokenizer()
    factory = GrammarFactory(tok, len(tok), (tok.eos_token_id or 0,))
    compiles = []
    real = factory.compiler.compile_json_schema
    factory.compiler.compile_json_schema = lambda *a, **k: compiles.append(1) or real(*a, **k)
    with pytest.raises(SchemaRejected, match="repetition bounds"):
        factory.json_schema({"type": "string", "pattern": "^(a|b){1,20000}$"})
    with pytest.raises(SchemaRejected, match="repetition bounds"):
        factory.precompile({"type": "string", "pattern": "^(a|b){1,20000}$"}, timeout=60)
    assert not compiles
    factory.json_schema({"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"})
    assert compiles == [1]
