"""Sampling fields of `freetoken serve`, driven by the real `openai` client on the embedded model:
vLLM's `top_k` / `min_p` / `repetition_penalty` and OpenAI's presence / frequency penalties reach
the engine's sampler, `logprobs` / `top_logprobs` (raw model distribution, plain and streamed), and
`n` choices decoded from one prefill of the prompt."""

from __future__ import annotations

import httpx
import pytest
import torch
from serve_harness import MODEL, TOOLS
from transformers import RepetitionPenaltyLogitsProcessor

pytestmark = pytest.mark.usefixtures("one_thread")

WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(client, **kwargs):
    kwargs.setdefault("messages", WEATHER)
    kwargs.setdefault("max_tokens", 12)
    return client.chat.completions.create(model=MODEL, **kwargs)


def texts(client, seeds, **kwargs) -> list[str]:
    return [chat(client, temperature=1.0, seed=s, **kwargs).choices[0].message.content for s in seeds]


def test_top_k_1_at_temperature_1_gives_the_greedy_text_for_every_seed(client):
    seeds = (1, 2, 3)
    assert len(set(texts(client, seeds))) > 1  # without top_k these seeds write different texts
    greedy = chat(client, temperature=0).choices[0].message.content
    assert texts(client, seeds, extra_body={"top_k": 1}) == [greedy] * 3
    assert texts(client, seeds, extra_body={"min_p": 1.0}) == [greedy] * 3  # only the best is kept
    assert len(set(texts(client, seeds, extra_body={"top_k": -1}))) > 1  # vLLM's "off"


def reply_ids(server, response) -> list[int]:
    """The token ids of the (n = 1) reply the server just decoded: its context after the prompt."""
    context = server.app.state.server.backend.token_ids
    prompt = response.usage.prompt_tokens
    return context[prompt : prompt + response.usage.completion_tokens]


def engine_logprobs(server, ids: list[int]) -> torch.Tensor:
    """log_softmax of the engine's logits for each position of `ids` (one prefill)."""
    with server.engine.new_session() as session:
        logits = session.prefill(ids)
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0), dict(temperature=1.8, seed=4, presence_penalty=2.0, extra_body={"top_k": 5})],
    ids=["greedy", "sampled-and-penalised"],
)
def test_logprobs_are_the_raw_model_distribution(server, client, sampling):
    r = chat(client, logprobs=True, top_logprobs=3, **sampling)
    entries = r.choices[0].logprobs.content
    ids = reply_ids(server, r)
    assert entries and len(entries) <= len(ids)
    context = server.app.state.server.backend.token_ids
    prompt = r.usage.prompt_tokens
    ref = engine_logprobs(server, context[: prompt + len(entries)])[prompt - 1 :]
    for i, e in enumerate(entries):
        row = ref[i]
        assert e.logprob == pytest.approx(float(row[ids[i]]), abs=1e-4)  # not tempered nor penalised
        assert len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(
            torch.topk(row, 3).values.tolist(), abs=1e-4
        )
        assert e.bytes == list(e.token.encode()) and all(
            t.bytes == list(t.token.encode()) for t in e.top_logprobs
        )
        if sampling["temperature"] == 0:
            assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
    if r.choices[0].finish_reason == "length":
        assert "".join(e.token for e in entries) == r.choices[0].message.content
    assert chat(client, temperature=0).choices[0].logprobs is None  # only when asked


def test_streamed_logprobs_are_the_same_tokens(client):
    plain = chat(client, temperature=0, logprobs=True, top_logprobs=2)
    chunks = list(chat(client, temperature=0, logprobs=True, top_logprobs=2, stream=True))
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in plain.choices[0].logprobs.content]
    assert len([c for c in chunks if c.choices and c.choices[0].logprobs]) > 1  # streamed with the text
    no_top = chat(client, temperature=0, logprobs=True).choices[0].logprobs.content
    assert no_top and all(e.top_logprobs == [] for e in no_top)


def test_logprobs_of_a_json_reply(client):
    r = chat(client, temperature=0, logprobs=True, response_format={"type": "json_object"}, max_tokens=24)
    entries = r.choices[0].logprobs.content
    assert entries and all(e.logprob <= 0 for e in entries)  # the sampled tokens (not the forced ones)


def test_logprobs_of_a_forced_tool_call(client):
    """The tokens sampled inside a call's arguments (the constrained decoder's) have entries too;
    they come with the finish chunk, as no content delta carries them."""
    r = chat(client, temperature=0, logprobs=True, tools=TOOLS, tool_choice="required", max_tokens=24)
    assert r.choices[0].message.tool_calls and r.choices[0].message.content is None
    entries = r.choices[0].logprobs.content
    assert entries and all(e.logprob <= 0 for e in entries)
    chunks = list(
        chat(
            client,
            temperature=0,
            logprobs=True,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=24,
            stream=True,
        )
    )
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_n_choices_share_one_prefill_and_each_has_its_own_seed(server, client):
    forwards: list[tuple[str, int, int]] = []
    engine = server.engine
    old = engine.on_forward
    engine.on_forward = lambda session, start, count: forwards.append((session, start, count))
    try:
        messages = [{"role": "user", "content": "Name three colours of the sea, please."}]
        r = chat(client, messages=messages, temperature=1.0, seed=5, n=3, max_tokens=8)
    finally:
        engine.on_forward = old
    prefills = [f for f in forwards if f[2] > 1]
    assert len(prefills) == 1  # the prompt, once: the other choices decode in forks of it
    assert len({session for session, _, _ in forwards}) == 3
    assert [c.index for c in r.choices] == [0, 1, 2]
    # choice i samples with seed + i (vLLM's rule): the same text as a single reply with that seed
    alone = [chat(client, messages=messages, temperature=1.0, seed=5 + i, max_tokens=8) for i in range(3)]
    for c, a in zip(r.choices, alone, strict=True):
        assert (c.message.content, c.finish_reason) == (
            a.choices[0].message.content,
            a.choices[0].finish_reason,
        )
    assert len({c.message.content for c in r.choices}) > 1
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens  # counted once
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_n_choices_stream_with_their_index_and_one_usage(client):
    plain = chat(client, temperature=1.0, seed=11, n=2, max_tokens=8)
    chunks = list(
        chat(
            client,
            temperature=1.0,
            seed=11,
            n=2,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for choice in plain.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant"
        assert "".join(d.delta.content or "" for d in mine) == choice.message.content
        assert [d.finish_reason for d in mine if d.finish_reason] == [choice.finish_reason]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and chunks[-1].usage == usage[0]
    assert usage[0].completion_tokens == plain.usage.completion_tokens
    assert usage[0].prompt_tokens == plain.usage.prompt_tokens


def test_penalties_change_the_reply_as_the_reference_says(server, client):
    """Greedy with penalties: the server's tokens are those a loop over the same engine picks with
    transformers' RepetitionPenaltyLogitsProcessor (prompt + reply) and OpenAI's presence /
    frequency formula (the reply only)."""
    plain = chat(client, temperature=0, max_tokens=16)
    r = chat(
        client,
        temperature=0,
        max_tokens=16,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        extra_body={"repetition_penalty": 1.3},
    )
    assert r.choices[0].message.content != plain.choices[0].message.content
    context = server.app.state.server.backend.token_ids
    prompt = context[: r.usage.prompt_tokens]
    got = reply_ids(server, r)
    out: list[int] = []
    with server.engine.new_session() as session:
        logits = session.prefill(prompt, last_only=True)[-1].float()
        for token in got:
            scores = RepetitionPenaltyLogitsProcessor(1.3)(
                torch.tensor([prompt + out]), logits[None].clone()
            )[0]
            for t in set(out):
                scores[t] -= out.count(t) * 1.0 + 0.5
            assert int(torch.argmax(scores)) == token
            out.append(token)
            logits = session.decode(token).float()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (dict(n=9), "n"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0), "repetition_penalty"),
    ],
)
def test_out_of_bounds_sampling_fields_are_a_400(server, extra, param):
    body = {"model": MODEL, "messages": WEATHER, "max_tokens": 2, **extra}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert param in (r.json()["error"]["param"] or "") or param in r.json()["error"]["message"]
