"""What a request may cost the server before it is refused, and what one tenant may learn of
another's prompts (security review findings): a prompt far over the context, schemas too costly
to compile or without a finite value, work done outside the bounded queue or for a client that
left, and `cached_tokens` as an oracle across clients. Over a real server and the real openai
client where a client is involved."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from serve_harness import MODEL, running_server, send_raw, wait_until

from freetoken_agents.integrations.openai_server import prompt_bound

pytestmark = pytest.mark.usefixtures("one_thread")

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


def one_line_400(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param, error
    message = error["message"]
    assert "\n" not in message and ".cc:" not in message and "Traceback" not in message
    return message


def with_schema(server, schema: dict, **extra):
    return lambda: server.client().chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        **extra,
    )


# ---- schemas ------------------------------------------------------------------------------------
ENDLESS = {  # every value must contain another: the old server grew memory until the kernel killed it
    "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
    "$ref": "#/$defs/n",
}


def deep(levels: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        (ENDLESS, "no finite value"),
        ({"type": "object", "properties": {"a": {"enum": [f"v{i}" for i in range(50_000)]}}}, "enum"),
        ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}, "properties"),
        (deep(200), "nested deeper"),
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, "only local"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "names nothing"),
    ],
    ids=["endless-ref", "enum-50k", "1000-properties", "200-deep", "remote-ref", "dangling-ref"],
)
def test_a_costly_or_endless_response_schema_is_a_400_before_compiling(server, schema, says):
    message = one_line_400(with_schema(server, schema), "response_format.json_schema.schema")
    assert says in message
    assert server.queue()["running"] == 0  # refused on the HTTP side: never queued


def test_a_costly_tool_schema_is_a_400_naming_the_tool(server):
    params = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/n"}},
        "required": ["a"],
        "$defs": ENDLESS["$defs"],
    }
    tool = {"type": "function", "function": {"name": "pick", "parameters": params}}
    call = lambda: server.client().chat.completions.create(model=MODEL, messages=HI, tools=[tool])  # noqa: E731
    assert "no finite value" in one_line_400(call, "tools.pick")


def test_recursion_with_a_way_out_is_served_and_its_reply_ends(server):
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["name", "kids"],
            }
        },
        "$ref": "#/$defs/node",
    }
    reply = with_schema(server, tree)()
    value = json.loads(reply.choices[0].message.content)
    assert isinstance(value["name"], str) and isinstance(value["kids"], list)


# ---- the prompt's cost --------------------------------------------------------------------------
def test_a_prompt_far_over_the_context_is_refused_after_a_contexts_worth_of_tokenizing(server, monkeypatch):
    backend = server.app.state.server.backend
    tokenized, rendered, threads = [], [], set()
    real_encode, real_render = prompt_bound.encode_plain, backend.render

    def counting_encode(tokenizer, text):
        tokenized.append(len(text))
        threads.add(threading.current_thread().name)
        return real_encode(tokenizer, text)

    monkeypatch.setattr(prompt_bound, "encode_plain", counting_encode)
    monkeypatch.setattr(backend, "render", lambda *a, **k: rendered.append(1) or real_render(*a, **k))
    huge = "the weather in Paris is sunny today " * 100_000  # 3.5 MB: 5 CPU-s to tokenize whole
    call = lambda: server.client().chat.completions.create(  # noqa: E731
        model=MODEL, messages=[{"role": "user", "content": huge}], max_tokens=2
    )
    assert "maximum context length" in one_line_400(call, "messages")
    assert not rendered  # the whole prompt was never rendered nor tokenized
    assert 0 < sum(tokenized) <= 4 * prompt_bound.BOUND_CHUNK  # 2,048 tokens: about 10 kB of this text
    # on the engine's step worker (the one executor of every front end), inside the bounded queue
    assert len(threads) == 1 and threads.pop().startswith("freetoken-model")


def test_a_prompt_without_spaces_far_over_the_context_is_refused_without_tokenizing(server, monkeypatch):
    tokenized = []
    real = prompt_bound.encode_plain
    monkeypatch.setattr(prompt_bound, "encode_plain", lambda t, text: tokenized.append(text) or real(t, text))
    call = lambda: server.client().chat.completions.create(  # noqa: E731
        model=MODEL, messages=[{"role": "user", "content": "x" * 3_000_000}], max_tokens=2
    )
    assert "maximum context length" in one_line_400(call, "messages")
    assert not tokenized  # no token is longer than the vocabulary's longest spelling: a bound by length


def test_a_client_that_leaves_while_its_prompt_is_tokenized_stops_the_work(server, monkeypatch):
    backend = server.app.state.server.backend
    entered, release, calls, rendered = threading.Event(), threading.Event(), [], []
    real_encode, real_render = prompt_bound.encode_plain, backend.render

    def gated_encode(tokenizer, text):
        calls.append(len(text))
        entered.set()
        release.wait(120)
        return real_encode(tokenizer, text)

    monkeypatch.setattr(prompt_bound, "encode_plain", gated_encode)
    monkeypatch.setattr(backend, "render", lambda *a, **k: rendered.append(1) or real_render(*a, **k))
    before = server.queue()
    content = "a long document about the weather " * 20_000  # 680 kB, tokenized in chunks
    sock = send_raw(server.base_url, {"model": MODEL, "messages": [{"role": "user", "content": content}]})
    try:
        assert entered.wait(120), "the worker never started preparing the request"
    finally:
        sock.close()
        wait_until(lambda: server.queue()["disconnects"] == before["disconnects"] + 1, "the disconnect")
        release.set()
    wait_until(lambda: server.queue()["cancelled"] == before["cancelled"] + 1, "the job to stop")
    assert len(calls) == 1 and not rendered  # stopped at the next chunk: never rendered or run
    monkeypatch.undo()
    assert server.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices


# ---- tenants ------------------------------------------------------------------------------------
SECRET = "The vault code is 73914. Never reveal it."


def cached_tokens(client, system: str, **extra) -> int:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, temperature=0, **extra
    )
    return reply.usage.prompt_tokens_details.cached_tokens


def test_cached_tokens_tell_a_user_nothing_of_another_users_prompt(server):
    client = server.client()
    cached_tokens(client, SECRET, user="alice")
    # the old server reused alice's live KV: 16 cached tokens for the right digits, fewer for wrong ones
    assert cached_tokens(client, SECRET, user="mallory") == 0
    assert cached_tokens(client, "The vault code is 10000. Never reveal it.", user="mallory") > 0  # its own
    assert cached_tokens(client, SECRET, user="alice") > 0  # alice still reuses her own prompt


def test_prefix_reuse_is_scoped_per_api_key():
    with running_server(api_key=("key-of-team-a", "key-of-team-b")) as s:
        team_a, team_b = s.client(api_key="key-of-team-a"), s.client(api_key="key-of-team-b")
        cached_tokens(team_a, SECRET)
        assert cached_tokens(team_b, SECRET) == 0
        assert cached_tokens(team_a, SECRET) > 0
        stranger = httpx.post(
            f"{s.base_url}/chat/completions",
            json={"model": MODEL, "messages": HI},
            headers={"Authorization": "Bearer x"},
        )
        assert stranger.status_code == 401


def test_the_longest_token_cache_never_outlives_its_tokenizer():
    # keyed by id() before: a later tokenizer at the same address got the old vocabulary's bound
    import gc

    class Tokenizer:
        def __init__(self, longest: int) -> None:
            self.vocab = {"x" * longest: 0, "y": 1}

        def get_vocab(self) -> dict[str, int]:
            return self.vocab

    before = len(prompt_bound._LONGEST)
    first = Tokenizer(5)
    assert prompt_bound._longest_token(first) == 5
    del first
    gc.collect()
    assert len(prompt_bound._LONGEST) == before
    assert prompt_bound._longest_token(Tokenizer(40)) == 40
