"""Grammar-constrained JSON keeps the schema's property order (regression: sorted keys)."""

from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")

from tiny_models import make_tiny_tokenizer  # noqa: E402

from freetoken_agents.constrained import GrammarFactory  # noqa: E402


def _forced_prefix(schema: dict) -> str:
    tok = make_tiny_tokenizer()
    factory = GrammarFactory(tok, len(tok), (tok.eos_token_id or 0,))
    return factory.json_schema(schema).forced_text()


def test_properties_follow_the_schema_order_not_alphabetical() -> None:
    call = {
        "type": "object",
        "properties": {"name": {"const": "add"}, "arguments": {"type": "object"}},
        "required": ["name", "arguments"],
    }
    assert _forced_prefix(call).startswith('{"name": "add"')


def test_schemas_differing_only_in_order_compile_to_different_grammars() -> None:
    zb = {"type": "object", "properties": {"z": {"type": "integer"}, "b": {"type": "integer"}},
          "required": ["z", "b"]}  # fmt: skip
    bz = {"type": "object", "properties": {"b": {"type": "integer"}, "z": {"type": "integer"}},
          "required": ["b", "z"]}  # fmt: skip
    assert _forced_prefix(zb).startswith('{"z"')
    assert _forced_prefix(bz).startswith('{"b"')
