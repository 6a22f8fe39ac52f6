"""JSON schemas from untrusted callers never reach the grammar compiler when they would cost too much
or have no finite value: `SchemaRejected`, one line, before compiling (the SDK's own decoders and
the server share this check through `GrammarFactory.json_schema`)."""

from __future__ import annotations

import pytest

from freetoken_agents import FreeTokenModel, SchemaRejected, default_model
from freetoken_agents.constrained import GRAMMAR_CACHE_SIZE
from freetoken_agents.engine import Engine
from freetoken_agents.schema_check import MAX_DEPTH, MAX_ENUM, MAX_NODES, MAX_PROPERTIES, check_schema

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_model() -> FreeTokenModel:
    return FreeTokenModel(Engine.from_pretrained(default_model()))


def ref_loop(required: bool) -> dict:
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}
    if required:
        node["required"] = ["next"]
    return {"$defs": {"n": node}, "$ref": "#/$defs/n"}


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    "schema",
    [
        ref_loop(required=False),  # {} ends it
        {"type": "object", "properties": {"child": {"$ref": "#"}}},
        {"$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}}, "$ref": "#/$defs/t"},  # []
        {  # an expression tree: the integer branch ends it
            "$defs": {
                "e": {
                    "anyOf": [
                        {"type": "integer"},
                        {"type": "object", "properties": {"l": {"$ref": "#/$defs/e"}}, "required": ["l"]},
                    ]
                }
            },
            "$ref": "#/$defs/e",
        },
        {"type": "object", "properties": {"a": {"enum": list(range(MAX_ENUM))}}},
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_PROPERTIES)}},
        nested(MAX_DEPTH // 2 - 1),
        {"$defs": {"a~b/c": {"type": "string"}}, "$ref": "#/$defs/a~0b~1c"},  # JSON-pointer escapes
    ],
    ids=[
        "optional-loop",
        "root-ref",
        "empty-array",
        "anyof-exit",
        "max-enum",
        "max-props",
        "deep-ok",
        "escapes",
    ],
)
def test_schemas_a_user_may_send_are_accepted(schema):
    check_schema(schema)


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        (ref_loop(required=True), "no finite value"),
        (
            {  # minItems forces the recursion
                "$defs": {"t": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/t"}}},
                "$ref": "#/$defs/t",
            },
            "no finite value",
        ),
        ({"allOf": [{"$ref": "#"}]}, "no finite value"),
        ({"type": "object", "properties": {"a": {"enum": list(range(MAX_ENUM + 1))}}}, "enum entries"),
        ({"properties": {f"p{i}": {} for i in range(MAX_PROPERTIES + 1)}}, "properties"),
        (nested(MAX_DEPTH), "nested deeper"),
        (nested(10_000), "nested deeper"),  # no RecursionError on the way
        ({"type": "array", "prefixItems": [{"type": "integer"}] * MAX_NODES}, "values"),
        ({"$ref": "other.json#/a"}, "only local"),
        ({"$ref": 7}, "only local"),
        ({"$ref": "#/$defs/none"}, "names nothing"),
        ("string", "must be an object"),
    ],
    ids=[
        "required-loop",
        "min-items-loop",
        "allof-self",
        "enum",
        "props",
        "depth",
        "very-deep",
        "nodes",
        "remote",
        "ref-type",
        "dangling",
        "not-object",
    ],
)
def test_costly_endless_or_broken_schemas_are_refused_in_one_line(schema, says):
    with pytest.raises(SchemaRejected) as caught:
        check_schema(schema)
    assert says in str(caught.value) and "\n" not in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_the_grammar_factory_refuses_before_compiling_and_keeps_a_bounded_cache(tiny_model):
    grammars = tiny_model.grammars()
    with pytest.raises(SchemaRejected):  # the old factory compiled it; decoding it never ended
        grammars.json_schema(ref_loop(required=True))
    for i in range(GRAMMAR_CACHE_SIZE + 5):
        grammars.json_schema({"type": "object", "properties": {f"k{i}": {"type": "integer"}}})
    assert len(grammars._cache) == GRAMMAR_CACHE_SIZE  # a server sees schemas without end


def test_decode_json_of_an_endless_schema_is_a_named_error_not_a_hang(tiny_model):
    tiny_model.reset()
    tiny_model.sync(tiny_model.render([{"role": "user", "content": "hi"}], None))
    with pytest.raises(SchemaRejected):
        list(tiny_model.decode_json(ref_loop(required=True), max_tokens=8))
