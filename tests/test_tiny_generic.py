"""The generic tool-use corpus (recipes/tiny/generic.py) and the warm start from an FTW file: requests
carry every argument value, calls validate against the offered schemas, held-out domains and
wordings never reach training, and the shipped model loads into transformers with the engine's
logits."""

from __future__ import annotations

import random

import jsonschema
import pytest
import torch

from freetoken_agents import FreeTokenModel, default_model
from freetoken_agents.recipes.tiny import generic
from freetoken_agents.recipes.tiny.corpus import TOOL_SCHEMAS, build_corpus
from freetoken_agents.recipes.tiny.domains import DOMAINS, HELDOUT_DOMAINS
from freetoken_agents.recipes.tiny.evaluate_generic import heldout_cases, no_fit_cases
from freetoken_agents.recipes.tiny.examples import render


def _requests(split: str, count: int, seed: int = 0) -> list[generic.Request]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        tools = generic.toolset(rng, split, rng.choice([1, 2, 3, 4]))
        out.append(generic.make_request(rng, rng.choice(tools), split))
    return out


def _said(value: object) -> list[str]:
    """How a value can read in a request."""
    if isinstance(value, bool):
        return ["true", "yes", "on", "True"] if value else ["false", "no", "off", "False"]
    return [str(value)]


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_requests_carry_every_argument_value(split):
    for request in _requests(split, 600):
        for name, value in request.arguments.items():
            values = value.values() if isinstance(value, dict) else [value]
            for v in values:
                assert any(s in request.text for s in _said(v)), (name, v, request.text)


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_calls_validate_against_the_offered_schema(split):
    for request in _requests(split, 600, seed=1):
        jsonschema.validate(request.arguments, request.tool.schema["function"]["parameters"])
        assert request.tool.required <= set(request.arguments)


def test_heldout_domains_and_wordings_never_reach_training():
    train_names = {n for d in DOMAINS if d.key not in HELDOUT_DOMAINS for n in d.names}
    heldout_names = {n for d in DOMAINS if d.key in HELDOUT_DOMAINS for n in d.names} - train_names
    heldout_phrases = {
        piece
        for d in DOMAINS
        if d.key in HELDOUT_DOMAINS
        for p in d.phrases
        for piece in p.split("{v}")
        if len(piece) >= 12
    }
    frames = {f.split("{")[0] for fs in generic.HELDOUT_FRAMES.values() for f in fs}
    from transformers import PreTrainedTokenizerFast

    from freetoken_agents.engine import DEFAULT_CHAT_TEMPLATE
    from freetoken_agents.recipes.tiny.tokenizer import character_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=character_tokenizer(), chat_template=DEFAULT_CHAT_TEMPLATE)
    texts = [render(tok, d)[0] for d in build_corpus(random.Random(0), 3000)]
    assert sum("<tool_call>" in t for t in texts) > 1000
    for text in texts:
        assert not any(f'"{name}"' in text for name in heldout_names)
        assert not any(frame in text for frame in frames)
        assert not any(phrase in text for phrase in heldout_phrases)
    # ... and the evaluation's requests do use them
    cases = heldout_cases(200, seed=1234)
    assert all(request.tool.name not in train_names for _, request in cases)
    assert any(any(frame in request.text for frame in frames) for _, request in cases)


def test_training_requests_cover_other_scripts_vowel_initial_places_and_function_notation():
    texts = [r.text for r in _requests("train", 3000, seed=2)]
    assert sum(any(0x4E00 <= ord(c) <= 0x9FFF for c in t) for t in texts) > 20
    assert sum(any(0x3041 <= ord(c) <= 0x30FA for c in t) for t in texts) > 20
    places = [v for r in _requests("train", 3000, seed=3) for v in r.arguments.values() if isinstance(v, str)]
    assert any(p[:1] in "AEIOU" and p[1:2].islower() for p in places)
    assert sum("(" in t and ")?" in t for t in texts) > 20  # "What is the value of name(3)?"


def test_no_fit_cases_offer_no_tool_for_the_request():
    for tools, text in no_fit_cases(60, seed=5):
        offered = {t["function"]["name"] for t in tools}
        assert tools and not any(f"{name}(" in text for name in offered)


@pytest.mark.parametrize("share", [0.2, 0.5])
def test_no_call_share_sets_how_many_generic_exchanges_answer_without_a_call(share):
    rng = random.Random(0)
    tools = generic.toolset(rng, "train", 2)
    exchanges = [generic.exchange(rng, tools, "train", no_call_share=share) for _ in range(2000)]
    direct = sum(len(e) == 2 and "tool_calls" not in e[1] for e in exchanges) / len(exchanges)
    assert abs(direct - share) < 0.03


def test_plain_requests_carry_only_the_intent_and_the_values():
    """The copy-first curriculum's requests: no greeting, tail or closing words, every value kept."""
    rng = random.Random(3)
    openers = [p.strip() for p in generic.PREFIXES if p] + ["hey"]
    closers = [s.strip() for s in generic.SUFFIXES + generic.TAILS if s]
    for _ in range(400):
        tools = generic.toolset(rng, "train", rng.choice([1, 2, 3]))
        request = generic.make_request(rng, rng.choice(tools), "train", plain=True)
        assert not any(request.text.startswith(o) for o in openers), request.text
        assert not any(request.text.endswith(c) for c in closers), request.text
        primary = request.tool.params[0].name
        assert str(request.arguments[primary]).split()[0] in request.text


def test_a_plain_generic_corpus_calls_a_tool_in_every_exchange():
    dialogues = build_corpus(random.Random(2), 400, no_call_share=0.0, plain_generic=True)
    generic_turns = [d for d in dialogues if d.tools and d.tools != TOOL_SCHEMAS]
    assert len(generic_turns) > 100
    for d in generic_turns:
        users = [m for m in d.messages if m["role"] == "user"]
        calls = [m for m in d.messages if m.get("tool_calls")]
        assert len(calls) == len(users)
        assert not any(m["content"].startswith(("Hi! ", "Hello. ", "Hey, ", "Quick question")) for m in users)


def test_the_world_tools_stay_in_the_corpus():
    corpus = build_corpus(random.Random(4), 500)
    assert 40 < sum(d.tools == TOOL_SCHEMAS for d in corpus) < 110
    assert 100 < sum(not d.tools for d in corpus) < 200  # coding dialogues


@pytest.mark.usefixtures("one_thread")
def test_warm_start_loads_the_shipped_model_with_the_engines_logits():
    from freetoken_agents.recipes.tiny.warm import load_ftw

    model, tokenizer = load_ftw(default_model(), max_position_embeddings=2048)
    engine_model = FreeTokenModel.from_pretrained(default_model())
    ids = engine_model.render([{"role": "user", "content": "What is the weather in Paris?"}], TOOL_SCHEMAS)
    assert list(ids) == list(tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOL_SCHEMAS,
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])  # fmt: skip
    engine_model.sync(ids)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(ids)])).logits[0, -1]
    torch.testing.assert_close(logits, engine_model.next_logits().float(), atol=1e-4, rtol=1e-4)
