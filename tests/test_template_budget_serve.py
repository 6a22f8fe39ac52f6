"""`freetoken serve` over a model whose tokenizer carries a hostile chat template (issue 59, item
7): the request gets a one-line 400 naming the budget the template broke, not a hang or a 500,
and the server goes on serving."""

from __future__ import annotations

import httpx
import pytest
from serve_harness import MODEL, running_server, shared_engine

from freetoken_agents.engine import Engine
from freetoken_agents.engine.template import budget as tb

pytestmark = pytest.mark.usefixtures("one_thread")

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(shared_engine().source)  # its own tokenizer object, to swap templates


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine) as s:
        yield s


def chat(server) -> httpx.Response:
    body = {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0}
    return httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)  # a net, not a bound


NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize(
    ("template", "says"),
    [(NESTED, "TEMPLATE_RENDER_SECONDS"), ("{{ 'x' * 10**9 }}", "TEMPLATE_MAX_CHARS")],
    ids=["nested-range", "gigabyte-string"],
)
def test_a_hostile_template_is_a_400_and_the_server_goes_on(server, engine, monkeypatch, template, says):
    monkeypatch.setattr(tb, "TEMPLATE_RENDER_SECONDS", 0.5)  # the default (5 s) holds the same way
    own = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = template
    try:
        response = chat(server)
    finally:
        engine.tokenizer.chat_template = own
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert says in error["message"] and "\n" not in error["message"], error
    assert error["param"] == "messages"
    served = chat(server)  # the same server and worker, the model's own template again
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["finish_reason"] in ("stop", "length")
