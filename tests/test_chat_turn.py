"""One chat turn for every front end: `GenerateRequest.stop` is handled once, in the SDK's turn
decoder (on the real embedded model), and ChatFreeToken, `freetoken serve` and `freetoken chat` all
run their replies on `integrations.chat_turn.run_chat_turn`, so a stop string split across tokens
is held back and cut identically everywhere."""

from __future__ import annotations

import io
import sys

import pytest
from serve_harness import MODEL, TOOLS, running_server, shared_engine

import freetoken_agents.integrations.chat_turn as chat_turn
from freetoken_agents import default_model
from freetoken_agents.cli import main
from freetoken_agents.integrations.langchain import ChatFreeToken
from freetoken_agents.model import FreeTokenModel, GenerateRequest

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTION = "What is the weather in Paris?"
MESSAGES = [{"role": "user", "content": QUESTION}]


def _pieces(model: FreeTokenModel, **request) -> tuple[list[str], str | None]:
    """The text deltas and the finish reason of one turn after the question."""
    model.sync(model.render(MESSAGES, None))
    events = list(model.generate(GenerateRequest(max_new_tokens=24, **request)))
    assert events[-1].kind == "done"
    return [e.text for e in events if e.kind == "text"], events[-1].finish_reason


@pytest.fixture(scope="module")
def model() -> FreeTokenModel:
    return FreeTokenModel(shared_engine())


@pytest.fixture(scope="module")
def split_stop(model) -> tuple[str, str]:
    """A stop string made of the end of one decoded text delta and the start of the next (it first
    occurs there), and the reply's text before it."""
    pieces, _ = _pieces(model)
    text = "".join(pieces)
    at = 0
    for a, b in zip(pieces, pieces[1:], strict=False):
        at += len(a)
        stop = a[-1] + b[0]
        if text.index(stop) == at - 1:
            return stop, text[: at - 1]
    pytest.skip(f"no token boundary where a two-character stop string first occurs in {text!r}")


def test_a_stop_string_split_across_tokens_is_held_back_and_cut_by_the_sdk(model, split_stop) -> None:
    stop, before = split_stop
    pieces, finish = _pieces(model, stop=[stop])
    assert "".join(pieces) == before and finish == "stop"  # its first character was never delivered
    # no stop strings: the same reply as before, in full
    plain, _ = _pieces(model, stop=["never in this reply \x00"])
    assert "".join(plain).startswith(before + stop)


def test_stop_strings_do_not_apply_inside_a_tool_calls_arguments(model) -> None:
    model.sync(model.render(MESSAGES, TOOLS))
    request = GenerateRequest(tools=TOOLS, force="get_weather", max_call_tokens=48, stop=['"', "{"])
    events = list(model.generate(request))
    text = "".join(e.text for e in events if e.kind == "text")
    parsed = model.parser.parse(text, TOOLS)
    assert [c.name for c in parsed.calls] == ["get_weather"] and not parsed.calls[0].error
    assert events[-1].finish_reason == "stop"


def test_every_front_end_runs_the_one_chat_turn(model, split_stop, monkeypatch, capsys) -> None:
    stop, before = split_stop
    sdk, _ = _pieces(model, stop=[stop])
    requests: list[chat_turn.ChatTurnRequest] = []
    events = chat_turn._events

    def spy(backend, request, tools_on):
        requests.append(request)
        return events(backend, request, tools_on)

    monkeypatch.setattr(chat_turn, "_events", spy)

    llm = ChatFreeToken(model=str(default_model()), temperature=0.0, max_tokens=24)
    chunks = list(llm.stream(QUESTION, stop=[stop]))
    langchain = [c.content for c in chunks if c.content]
    assert chunks[-1].response_metadata["finish_reason"] == "stop"
    assert requests[-1].stop == (stop,)

    with running_server() as server:
        stream = server.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, stop=[stop], stream=True
        )
        chunks = list(stream)
    served = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert requests[-1].stop == (stop,)

    # the same hold-back everywhere: the same deltas, ending before the stop string
    assert langchain == served == sdk and "".join(sdk) == before

    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{QUESTION}\n/quit\n"))
    assert main(["chat", "--system", "", "--max-new-tokens", "24", "--no-progress"]) == 0
    assert len(requests) == 3 and requests[-1].stop == ()
    assert f"assistant> {before}{stop}" in capsys.readouterr().out


def test_the_scripted_model_ends_a_turn_at_a_stop_string_too() -> None:
    from freetoken_agents.testing import ScriptedModel, ToolCall

    model = ScriptedModel(["Sunny, 21 degrees. Done.", ["Call: ", ToolCall("get_weather", {"city": "x"})]])
    model.sync(model.render(MESSAGES, None))
    events = list(model.generate(GenerateRequest(stop=["21 d"])))
    assert "".join(e.text for e in events if e.kind == "text") == "Sunny, " and events[-1].kind == "done"
    # not inside a tool call: the call's text has the stop string, the turn keeps it
    events = list(model.generate(GenerateRequest(tools=TOOLS, stop=["city"])))
    assert '"city"' in "".join(e.text for e in events if e.kind == "text")
