"""One engine, many clients: requests wait in a bounded queue (429 + Retry-After when it is full),
each gets exactly the answer it gets alone, and a client that disconnects cancels its job.

Deterministic without timing: the test holds `engine.lock`, so the worker waits at its first
engine step with a known job, while the test fills the queue or disconnects a client; the
server's /health counters say when each thing has happened.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from serve_harness import MODEL, running_server, send_raw, wait_until

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = ["What is 3 plus 4?", "What is the capital of France?", "What is the weather in Oslo?", "Hello!"]


def ask(client, question: str, *, stream: bool = False) -> str:
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=16)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(**kwargs, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.fixture(scope="module")
def server():
    with running_server(max_queue=2) as s:
        yield s


@pytest.fixture(scope="module")
def alone(server):
    """Each question's answer when it is the only request."""
    client = server.client()
    return {q: ask(client, q) for q in QUESTIONS}


@contextlib.contextmanager
def engine_held(server):
    """Hold the engine's lock: the worker blocks at its next engine step."""
    server.engine.lock.acquire()
    try:
        yield
    finally:
        server.engine.lock.release()


def test_a_full_queue_answers_429_and_the_queued_requests_get_their_own_answers(server, alone):
    client = server.client()
    before = server.queue()
    with ThreadPoolExecutor(3) as pool:
        with engine_held(server):
            running = pool.submit(ask, client, QUESTIONS[0])
            wait_until(lambda: server.queue()["running"] == 1, "the worker to take the first request")
            waiting = [pool.submit(ask, client, q, stream=i == 1) for i, q in enumerate(QUESTIONS[1:3])]
            wait_until(lambda: server.queue()["queued"] == 2, "two requests to wait in the queue")
            with pytest.raises(openai.RateLimitError) as e:
                ask(client, QUESTIONS[3])
            assert int(e.value.response.headers["retry-after"]) >= 1
            assert e.value.body["code"] == "rate_limit_exceeded"
        answers = [f.result() for f in (running, *waiting)]
    assert answers == [alone[q] for q in QUESTIONS[:3]]
    after = server.queue()
    assert after["rejected"] == before["rejected"] + 1
    assert after["completed"] == before["completed"] + 3


def test_concurrent_clients_each_get_exactly_their_answer(alone):
    with running_server(max_queue=16) as roomy:  # a second server (and session) on the same engine
        client = roomy.client()
        with ThreadPoolExecutor(8) as pool:
            jobs = [(q, i % 2 == 1) for i, q in enumerate(QUESTIONS * 2)]
            futures = [pool.submit(ask, client, q, stream=stream) for q, stream in jobs]
            assert [f.result() for f in futures] == [alone[q] for q, _ in jobs]
        assert roomy.queue()["completed"] == len(jobs) and roomy.queue()["rejected"] == 0


def test_a_client_that_disconnects_mid_stream_cancels_its_generation(server):
    client, backend = server.client(), server.app.state.server.backend
    before = server.queue()
    with engine_held(server):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=600,
            logit_bias={"2": -100},  # no end-of-turn token: left alone it would run all 600 tokens
            stream=True,
        )
        first = next(iter(stream))  # the worker has the job: headers and the role chunk are out
        assert first.choices[0].delta.role == "assistant"
        stream.close()
        wait_until(lambda: server.queue()["disconnects"] == before["disconnects"] + 1, "the disconnect")
        decoded = backend.usage().decoded
    wait_until(lambda: server.queue()["cancelled"] == before["cancelled"] + 1, "the job to stop")
    assert backend.usage().decoded - decoded <= 1  # stopped at its next step, not after 600 tokens
    assert server.queue()["completed"] == before["completed"]
    assert ask(client, QUESTIONS[0])  # and the server goes on


def test_a_client_that_leaves_while_queued_is_never_run(server, alone):
    client, backend = server.client(), server.app.state.server.backend
    before = server.queue()
    with ThreadPoolExecutor(1) as pool:
        with engine_held(server):
            running = pool.submit(ask, client, QUESTIONS[0])
            wait_until(lambda: server.queue()["running"] == 1, "the worker to take the first request")
            leaver = send_raw(
                server.base_url, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
            )
            wait_until(lambda: server.queue()["queued"] == 1, "the second request to wait")
            leaver.close()
            wait_until(lambda: server.queue()["disconnects"] == before["disconnects"] + 1, "the disconnect")
        assert running.result() == alone[QUESTIONS[0]]
    wait_until(lambda: server.queue()["cancelled"] == before["cancelled"] + 1, "the job to be dropped")
    after = server.queue()
    assert after["completed"] == before["completed"] + 1 and after["queued"] == 0
    # The engine's context is still the first request's conversation: the dropped one never ran.
    first_prompt = backend.render([{"role": "user", "content": QUESTIONS[0]}], None)
    assert backend.token_ids[: len(first_prompt)] == first_prompt
