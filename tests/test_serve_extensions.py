"""llama-server's and vLLM's request fields, sent by the real `openai` client through `extra_body`
(issue 63, item 6): each is honoured or refused with a 400 naming it, never silently ignored;
a field no peer defines is ignored, as OpenAI's own server would."""

from __future__ import annotations

import json

import openai
import pytest
from serve_harness import MODEL, running_server

pytestmark = pytest.mark.usefixtures("one_thread")

HI = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_STOP = {"2": -100}  # the embedded model's end-of-turn token: the reply runs to its bound


@pytest.fixture(scope="module")
def client():
    with running_server() as s:
        yield s.client()


def create(client, **extra):
    return client.chat.completions.create(model=MODEL, messages=HI, temperature=0, extra_body=extra)


def refused(client, param: str, **extra) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        create(client, max_tokens=4, **extra)
    body = info.value.body
    assert body["param"] == param, body
    return body["message"]


def test_n_predict_bounds_the_reply_like_max_tokens(client):
    r = create(client, n_predict=3, logit_bias=NO_STOP)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = create(client, n_predict=-1, max_tokens=2, logit_bias=NO_STOP)  # -1: llama-server's unset
    assert r.usage.completion_tokens == 2


def test_n_predict_that_differs_from_max_tokens_is_refused(client):
    assert "differs" in refused(client, "n_predict", n_predict=7)


def test_guided_json_decodes_under_the_schema(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = create(client, guided_json=schema)
    assert set(json.loads(r.choices[0].message.content)) == {"city"}
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "field, value",
    [
        ("ignore_eos", True),
        ("guided_decoding_backend", "outlines"),
        ("structured_outputs", {"structural_tag": "{}"}),  # its honoured keys: test_serve_guided
    ],
)
def test_fields_this_server_cannot_honour_are_refused_by_name(client, field, value):
    param = "structured_outputs.structural_tag" if field == "structured_outputs" else field
    assert param in refused(client, param, **{field: value})


def test_empty_template_kwargs_and_unknown_fields_change_nothing(client):
    plain = create(client, max_tokens=8)
    same = create(client, max_tokens=8, chat_template_kwargs={}, some_field_nobody_defines=1)
    assert same.choices[0].message.content == plain.choices[0].message.content


def test_add_generation_prompt_false_renders_no_assistant_header(client):
    with_header = create(client, max_tokens=1)
    without = create(client, max_tokens=1, add_generation_prompt=False)
    assert without.usage.prompt_tokens < with_header.usage.prompt_tokens
