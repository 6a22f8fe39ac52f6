"""The constrained JSON decoder: the schema's property order (regression: sorted keys), special
tokens kept out of strings, and values that always close inside their token budget."""

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


# ---- the constrained decoder over a model that wants the wrong tokens -------------------------------
import json  # noqa: E402

import torch  # noqa: E402

from freetoken_agents.constrained import ConstrainedDecode  # noqa: E402
from freetoken_agents.engine import SamplingParams  # noqa: E402
from freetoken_agents.engine.runtime.generate import Sampler  # noqa: E402

VOCAB = 512  # the tiny models' vocabulary: 480 tokenizer tokens + padding the grammar must mask


class ScoredModel:
    """A TokenStepper whose next-token logits are fixed scores (plus noise from `seed`): the
    decoder's mask is all that stands between these preferences and the output."""

    def __init__(self, scores: torch.Tensor, seed: int | None = None) -> None:
        self.scores, self.appended = scores, []
        self.rng = torch.Generator().manual_seed(seed) if seed is not None else None

    def next_logits(self) -> torch.Tensor:
        if self.rng is None:
            return self.scores.clone()
        return self.scores + torch.randn(self.scores.shape, generator=self.rng)

    def decode(self, token_id: int) -> None:
        self.appended.append(token_id)

    def prefill(self, token_ids) -> None:
        self.appended.extend(token_ids)


def _factory():
    tok = make_tiny_tokenizer()
    return tok, GrammarFactory(tok, VOCAB, (tok.eos_token_id,))


def _decode(schema: dict, scores: torch.Tensor, budget: int, seed: int | None = None, temperature=0.0):
    tok, factory = _factory()
    model = ScoredModel(scores, seed)
    sampler = Sampler(SamplingParams(temperature=temperature, seed=seed))
    run = ConstrainedDecode(model, factory.json_schema(schema), budget=budget, sampler=sampler, tokenizer=tok)
    text = "".join(run)
    assert model.appended == run.token_ids
    return run, text, tok


def test_special_tokens_never_enter_a_json_string() -> None:
    """The model prefers <|im_start|>, <tool_call>, ... above everything (the grammar alone would
    accept them inside a string as literal text)."""
    tok = make_tiny_tokenizer()
    scores = torch.zeros(VOCAB)
    specials = sorted(set(tok.all_special_ids) | set(tok.added_tokens_decoder))
    scores[specials] = 100.0
    scores[tok.convert_tokens_to_ids("a")] = 50.0
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    run, text, _ = _decode(schema, scores, budget=12)
    assert not set(run.token_ids) & set(specials)
    assert run.finish_reason == "stop" and json.loads(text)["s"].startswith("a")


NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
        },
        "note": {"type": "string"},
    },
    "required": ["name", "tags", "point", "note"],
}


def _never_closing_scores(tok) -> torch.Tensor:
    """Tokens that close nothing score high, closers low: left alone, the model never stops."""
    scores = torch.full((VOCAB,), -10.0)
    for i in range(len(tok)):
        piece = tok.decode([i])
        if piece and not any(c in piece for c in '"}]'):
            scores[i] = 10.0
    return scores


@pytest.mark.parametrize("extra", [0, 1, 2, 3, 5, 8, 13, 21])
def test_json_always_closes_inside_its_budget(extra: int) -> None:
    tok, factory = _factory()
    floor = factory.json_schema(NESTED).closing_cost()
    run, text, _ = _decode(NESTED, _never_closing_scores(tok), budget=floor + extra)
    value = json.loads(text)
    assert run.finish_reason == "stop" and run.sampled <= floor + extra
    assert set(value) == {"name", "tags", "point", "note"} and set(value["point"]) == {"x", "y"}
    assert isinstance(value["point"]["x"], int) and isinstance(value["tags"], list)


@pytest.mark.parametrize("seed", range(12))
def test_json_closes_under_random_sampling(seed: int) -> None:
    tok, factory = _factory()
    floor = factory.json_schema(NESTED).closing_cost()
    budget = floor + seed % 7
    run, text, _ = _decode(NESTED, _never_closing_scores(tok) * 0.2, budget, seed=seed, temperature=1.0)
    assert run.finish_reason == "stop" and run.sampled <= budget
    assert set(json.loads(text)) == {"name", "tags", "point", "note"}


def test_a_budget_below_the_shortest_value_ends_with_length() -> None:
    tok, factory = _factory()
    floor = factory.json_schema(NESTED).closing_cost()
    assert floor >= 2
    run, text, _ = _decode(NESTED, _never_closing_scores(tok), budget=floor - 1)
    assert run.finish_reason == "length" and run.sampled == floor - 1


def test_text_forced_after_the_last_sampled_token_is_still_written() -> None:
    """The budget's last sampled token may close a string; the brackets the grammar then forces
    are jump-forwarded even though no sampled token is left (regression: the call ended there)."""
    tok, factory = _factory()
    schema = {
        "type": "object",
        "properties": {
            "arguments": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            }
        },
        "required": ["arguments"],
    }
    floor = factory.json_schema(schema).closing_cost()
    for budget in range(floor, floor + 6):
        run, text, _ = _decode(schema, _never_closing_scores(tok), budget=budget)
        assert (
            run.finish_reason == "stop" and run.sampled <= budget and "city" in json.loads(text)["arguments"]
        )
