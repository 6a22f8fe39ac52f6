"""Sampling, streaming, stop conditions and chat templates on a real tiny engine."""

from __future__ import annotations

import pytest
import torch

from freetoken_agents.engine import Engine, SamplingParams
from freetoken_agents.engine.runtime.generate import Sampler


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint("qwen3_moe"))


def test_sampler_greedy_topk_topp():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert Sampler(SamplingParams())(logits) == 1
    picks = {Sampler(SamplingParams(temperature=1.0, top_k=2, seed=s))(logits) for s in range(40)}
    assert picks == {1, 3}
    # top_p small enough that only the best token survives
    assert {Sampler(SamplingParams(temperature=1.0, top_p=0.3, seed=s))(logits) for s in range(20)} == {1}


def test_seeded_sampling_is_repeatable(engine):
    a = engine.generate([5, 6, 7], max_new_tokens=12, temperature=1.0, seed=123, stop_token_ids=())
    b = engine.generate([5, 6, 7], max_new_tokens=12, temperature=1.0, seed=123, stop_token_ids=())
    c = engine.generate([5, 6, 7], max_new_tokens=12, temperature=1.0, seed=124, stop_token_ids=())
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stream_matches_generate_and_text(engine):
    prompt = engine.tokenizer.encode("def add(a, b):")
    events = list(engine.stream(prompt, max_new_tokens=10, stop_token_ids=()))
    result = engine.generate(prompt, max_new_tokens=10, stop_token_ids=())
    assert [e.token_id for e in events] == result.token_ids
    assert "".join(e.text for e in events) == engine.tokenizer.decode(result.token_ids)
    assert events[-1].finish_reason == "length" and all(e.finish_reason is None for e in events[:-1])


def test_stop_token_ends_generation(engine):
    prompt = [5, 6, 7]
    free = engine.generate(prompt, max_new_tokens=10, stop_token_ids=())
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    stopped = engine.generate(prompt, max_new_tokens=10, stop_token_ids=[stop_at])
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop_token"


def test_stop_string_cuts_text(engine):
    prompt = engine.tokenizer.encode("hello")
    free = engine.generate(prompt, max_new_tokens=12, stop_token_ids=())
    needle = free.text[4:6]
    assert needle
    stopped = engine.generate(prompt, max_new_tokens=12, stop_token_ids=(), stop_strings=[needle])
    assert stopped.finish_reason == "stop_string"
    assert stopped.text == free.text[: free.text.find(needle)]


def test_generation_stops_at_context_limit(engine):
    limit = engine.max_context
    result = engine.generate([1] * (limit - 3), max_new_tokens=10, stop_token_ids=())
    assert len(result.token_ids) == 3 and result.finish_reason == "length"


def test_session_keeps_the_last_generated_token_pending(engine):
    from freetoken_agents.engine.runtime.generate import stream_tokens

    with engine.new_session() as s:
        events = list(stream_tokens(s, [5, 6, 7], SamplingParams(max_new_tokens=4), None))
        assert s.token_ids == [5, 6, 7, *[e.token_id for e in events]]
        assert s.cached_tokens == s.position - 1
        nxt = s.decode(9)
    with engine.new_session() as fresh:
        expected = fresh.prefill([5, 6, 7, *[e.token_id for e in events], 9])[-1]
    assert torch.allclose(nxt, expected, atol=1e-5, rtol=0)


def test_chat_template_with_tools(engine):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two numbers",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "2+2?"}]
    ids = engine.apply_chat_template(messages, tools=tools)
    text = engine.tokenizer.decode(ids)
    assert "You are helpful." in text and '"name": "add"' in text
    assert text.rstrip().endswith("assistant")


def test_default_template_when_checkpoint_has_none(engine):
    tok = engine.tokenizer
    saved, tok.chat_template = tok.chat_template, None
    try:
        ids = engine.apply_chat_template([{"role": "user", "content": "hi"}])
    finally:
        tok.chat_template = saved
    assert engine.tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
