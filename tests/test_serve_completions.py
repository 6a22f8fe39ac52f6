"""POST /v1/completions (the legacy completions API) driven by the real `openai` client: raw text
in and out (no chat template), streaming, stop strings, echo, logprobs, usage and prefix reuse,
and the fields the server refuses with a 400 naming them, on the embedded model."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
from serve_harness import MODEL, running_server

from freetoken_agents.engine.runtime.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "def add(a, b):\n    return"


def raw_continuation(server, prompt: str, n: int, **sampling) -> str:
    """The greedy continuation of `prompt` as the engine writes it without any chat template
    (`sampling`: SamplingParams' penalties)."""
    tokenizer = server.engine.tokenizer
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    sampler = Sampler(SamplingParams(temperature=0, **sampling), ids)
    session = server.engine.new_session()
    try:
        out = []
        logits = session.prefill(ids, last_only=True)[-1]
        for _ in range(n):
            token = sampler(logits)
            sampler.observe(token)
            if token in server.engine.default_stop_token_ids():
                break
            out.append(token)
            logits = session.decode(token)
        return tokenizer.decode(out)
    finally:
        session.close()


def test_a_completion_continues_the_raw_prompt_with_usage(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    [choice] = r.choices
    assert choice.index == 0 and choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert choice.text == raw_continuation(server, PROMPT, 8)  # no chat template around the prompt
    prompt_ids = server.engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    u = r.usage
    assert u.prompt_tokens == len(prompt_ids) and 0 < u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_penalties_change_the_logits_as_the_engine_sampler_does(server, client):
    prompt = "1 2 3 1 2 3 1 2 3"
    penalties = {"frequency_penalty": 2.0, "presence_penalty": 1.0}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, **penalties)
    assert r.choices[0].text == raw_continuation(server, prompt, 12, **penalties)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert plain.choices[0].text == raw_continuation(server, prompt, 12)


def test_max_tokens_defaults_to_16_and_ends_with_length(client):
    r = client.completions.create(model=MODEL, prompt="The weather in Paris is", temperature=0)
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 16
    r = client.completions.create(model=MODEL, prompt="The weather in Paris is", max_tokens=1, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 1


def test_a_list_of_one_prompt_and_token_ids_are_the_same_prompt(server, client):
    ids = server.engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    texts = {
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
        for prompt in (PROMPT, [PROMPT], ids, [ids])
    }
    assert len(texts) == 1


def test_streaming_gives_the_same_text_in_chunks_then_usage_and_done(server, client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # really streamed
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    first = json.loads(lines[0][6:])
    assert first["object"] == "text_completion" and set(first["choices"][0]) >= {
        "text",
        "index",
        "finish_reason",
    }


def test_a_stop_string_cuts_the_text_before_it(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = next((full[i : i + 2] for i in range(1, len(full) - 2) if full[i : i + 2].strip()), None)
    assert stop is not None, f"no stop string to cut {full!r} at"
    for stream in (False, True):
        kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
        if stream:
            text = "".join(
                c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices
            )
        else:
            r = client.completions.create(**kwargs)
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].text
        assert text == full[: full.index(stop)]


def test_echo_returns_the_prompt_before_the_completion(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0).choices[0].text
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text == PROMPT + plain
    chunks = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + plain


def test_logprobs_give_tokens_their_log_probabilities_and_alternatives(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    choice = r.choices[0]
    lp = choice.logprobs
    n = len(lp.tokens)
    assert n > 0 and len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == choice.text or choice.finish_reason == "stop"
    for token, logprob, top, offset in zip(
        lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True
    ):
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert math.isclose(max(top.values()), logprob, abs_tol=1e-5)  # greedy: the likeliest token
        assert top.get(token) is not None and choice.text.startswith(token, offset)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, stream=True
    )
    tokens = [
        t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
    ]
    assert tokens == lp.tokens


def test_the_same_seed_samples_the_same_text(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7)
    assert (
        client.completions.create(**kwargs).choices[0].text
        == client.completions.create(**kwargs).choices[0].text
    )


def test_a_repeated_prompt_is_served_from_the_cache(client):
    prompt = PROMPT + " a + b\n\n\ndef mul(a, b):\n    return"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": [[1, 2], [3]]}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"n": 2}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "return x"}, "suffix"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"logprobs": 6}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
    ],
)
def test_what_the_server_cannot_do_is_a_400_naming_the_field(client, fields, param):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**body)
    assert caught.value.body["param"] == param, caught.value.body


def test_a_prompt_over_the_context_is_a_400_and_the_server_goes_on(server, client):
    long = "word " * (server.engine.max_context + 10)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=long, max_tokens=1)
    assert caught.value.body["param"] == "prompt" and caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=PROMPT, max_tokens=1)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).choices[0].text is not None


def test_an_api_key_guards_completions_too():
    with running_server(api_key="sekret") as s:
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        assert s.client(api_key="sekret").completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).choices
