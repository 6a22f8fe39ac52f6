"""Tool-call ids every chat template accepts (issue 35: Mistral's templates raise "Tool call IDs
should be alphanumeric strings with length 9!" on the second turn of the Agent, ChatFreeToken and
the server), and a template's refusal as a named error / a 400, never a 500."""

from __future__ import annotations

import re

import httpx
import pytest
from real_templates import model_with_template
from serve_harness import MODEL, running_server

from freetoken_agents import FreeTokenModel
from freetoken_agents.engine import ChatTemplateError
from freetoken_agents.parsers import new_call_id, step_call_id, template_call_id, with_template_call_ids

pytestmark = pytest.mark.usefixtures("one_thread")

NINE = re.compile(r"[A-Za-z0-9]{9}")
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def second_turn(call_id: str) -> list[dict]:
    """A conversation after one tool call, with the call's id as a client or the old Agent sent it."""
    call = {"id": call_id, "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    return [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "name": "add", "content": "3"},
    ]


def test_the_ids_we_make_have_the_form_every_template_accepts():
    assert all(NINE.fullmatch(new_call_id()) for _ in range(100))
    assert len({new_call_id() for _ in range(1000)}) == 1000
    ids = {step_call_id(step, i) for step in (0, 1, 35, 36, 10**6) for i in range(3)}
    assert len(ids) == 15 and all(NINE.fullmatch(i) for i in ids)


def test_a_foreign_id_maps_to_one_accepted_id_in_the_call_and_its_result():
    assert template_call_id("abcDEF123") == "abcDEF123"  # already accepted: kept
    mapped = template_call_id("call_7f3a9c0e11b2d4e5f6a7b8c9")
    assert NINE.fullmatch(mapped) and template_call_id("call_7f3a9c0e11b2d4e5f6a7b8c9") == mapped
    messages = second_turn("call_1_0")
    out = with_template_call_ids(messages)
    assert out[1]["tool_calls"][0]["id"] == out[2]["tool_call_id"] == template_call_id("call_1_0")
    assert messages[1]["tool_calls"][0]["id"] == "call_1_0"  # the caller's messages are untouched


@pytest.fixture
def mistral_nemo() -> FreeTokenModel:
    return model_with_template("mistralai-Mistral-Nemo-Instruct-2407", family="mistral")


@pytest.mark.parametrize("call_id", ["call_1_0", "call_7f3a9c0e11b2d4e5f6a7b8c9", "abcDEF123"])
def test_the_real_mistral_template_renders_a_second_turn_with_any_call_id(mistral_nemo, call_id):
    # the old render passed the id as is: the template raised for the first two
    text = mistral_nemo.engine.tokenizer.decode(mistral_nemo.render(second_turn(call_id), TOOLS))
    mapped = template_call_id(call_id)
    assert f'"id": "{mapped}"' in text and f'"call_id": "{mapped}"' in text


def test_a_template_refusal_is_a_named_error(mistral_nemo):
    with pytest.raises(ChatTemplateError, match="conversation roles must alternate"):
        mistral_nemo.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], None)


def test_the_server_answers_a_template_refusal_with_a_400(mistral_nemo):
    with running_server() as server:
        tokenizer = server.app.state.server.backend.engine.tokenizer
        own = tokenizer.chat_template
        tokenizer.chat_template = mistral_nemo.engine.tokenizer.chat_template
        try:
            two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
            r = httpx.post(
                f"{server.base_url}/chat/completions",
                json={"model": MODEL, "messages": two_users},
                timeout=60,
            )
        finally:
            tokenizer.chat_template = own
    assert r.status_code == 400, r.text  # the old server answered 500
    error = r.json()["error"]
    assert error["param"] == "messages" and "conversation roles must alternate" in error["message"]
