"""Relevant calls (freetoken_agents/relevance.py, `GenerateRequest.call_sources`): with tool_choice
auto the model may call only the offered tools the request is about. The word matching, then the
real embedded model through the turn decoder, the Agent and ChatFreeToken, pushed towards a call
by a logit bias so that only the gate stands between it and one."""

from __future__ import annotations

import functools

import pytest

from freetoken_agents import Agent, FreeTokenModel, GenerateRequest, default_model, tool
from freetoken_agents.model import trained_tools
from freetoken_agents.parsers.hermes import HermesParser
from freetoken_agents.relevance import acronyms, content_words, relevant_tools, tool_words, user_sources


def schema(name: str, description: str, **properties: str) -> dict:
    props = {key: {"type": kind} for key, kind in properties.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(props)},
        },
    }


FORECAST = schema("get_forecast", "The weather forecast for a city.", city="string")
EMAIL = schema("send_email", "Send an email to a recipient.", to="string")
SHARE = schema("fetchSharePrice", "Get the latest stock price for a ticker.", symbol="string")


# ---- the words ------------------------------------------------------------------------------------------
def test_content_words_drop_function_words_short_words_and_a_plural_s():
    assert content_words("What's the weather like in the cities of Osaka, please?") == {
        "weather",
        "citie",
        "osaka",
    }
    assert content_words("Send emails to my contacts") == {"send", "email", "contact"}
    assert content_words("the address, as is") == {"address"}  # "ss" is no plural; "as", "is" too short


def test_content_words_split_identifiers_and_keep_any_script():
    assert content_words("fetchSharePrice(QEV)") == {"fetch", "share", "price", "qev"}
    assert content_words("temp_convert") == {"temp", "convert"}
    assert content_words("Wetter in München") == {"wetter", "münchen"}


def test_tool_words_are_the_name_s_parts_and_the_description_s_words():
    assert tool_words(SHARE) == {"fetch", "share", "price", "stock", "ticker"}
    assert tool_words({"name": "bare_tool"}) == {"bare"}  # a bare schema, no description


def test_a_request_may_name_a_tool_by_the_acronym_of_words_of_its_description():
    """ "Get the bmi for a weight of 419" reached no tool: the held-out `body_mass_index: Compute the
    body mass index.` shares no word with it."""
    bmi = schema("body_mass_index", "Compute the body mass index.", weight="number")
    assert "bmi" in tool_words(bmi)
    assert relevant_tools([FORECAST, bmi], ["Get the bmi for a weight of 419."]) == [bmi]
    assert acronyms("Convert text to speech, or speech to text.") == set()  # runs of three words
    assert acronyms("Query the domain name system records.") == {"dns", "dnsr", "nsr"}


def test_relevant_tools_share_a_word_with_the_request_or_were_trained_keeping_their_order():
    tools = [FORECAST, EMAIL, SHARE]
    assert relevant_tools(tools, ["Will it rain? Check the forecast for Osaka."]) == [FORECAST]
    assert relevant_tools(tools, ["What is the share price of QEV?"]) == [SHARE]
    assert relevant_tools(tools, ["Email Bob the forecast"]) == [FORECAST, EMAIL]
    assert relevant_tools(tools, ["Hello! How are you?"]) == []
    assert relevant_tools(tools, ["How are you?"], trained={"send_email"}) == [EMAIL]
    assert relevant_tools(tools, ["one message", "then the forecast, please"]) == [FORECAST]


def test_relevance_is_judged_from_the_user_s_messages_only():
    messages = [
        {"role": "system", "content": "You forecast weather."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello"},
        {"role": "tool", "content": "forecast: sunny"},
        {"role": "user", "content": [{"type": "text", "text": "email it"}, {"type": "image"}]},
    ]
    assert user_sources(messages) == ["Hi there", "email it"]


# ---- the real embedded model ------------------------------------------------------------------------------
pytestmark_model = pytest.mark.usefixtures("one_thread")


@functools.cache
def model() -> FreeTokenModel:
    return FreeTokenModel.from_pretrained(default_model())


def turn(m: FreeTokenModel, text: str, tools: list[dict], **request: object) -> str:
    m.sync(m.render([{"role": "user", "content": text}], tools))
    return "".join(e.text for e in m.generate(GenerateRequest(tools=tools, **request)) if e.kind == "text")


def call_bias(m: FreeTokenModel) -> dict[int, float]:
    """A logit bias under which the model opens a call at its first token, wanted or not."""
    [marker] = m.tokenizer.encode(m.parser.start, add_special_tokens=False)
    return {marker: 100.0}


@pytestmark_model
def test_with_no_relevant_tool_the_turn_answers_without_a_call():
    m, text = model(), "Hello! How are you today?"
    pushed = turn(m, text, [FORECAST, EMAIL], logit_bias=call_bias(m), max_new_tokens=30)
    assert m.parser.parse(pushed, [FORECAST, EMAIL]).calls  # the bias alone makes it call
    gated = turn(m, text, [FORECAST, EMAIL], logit_bias=call_bias(m), max_new_tokens=30, call_sources=[text])
    assert "<tool_call>" not in gated and not m.parser.parse(gated, [FORECAST, EMAIL]).calls
    assert gated.strip()


@pytestmark_model
@pytest.mark.parametrize(
    ("text", "want"),
    [("Please email bob@example.com the news.", "send_email"), ("Forecast for Ulaanbaatar?", "get_forecast")],
)
def test_a_call_the_model_opens_chooses_among_the_relevant_tools_only(text: str, want: str):
    m = model()
    for tools in ([FORECAST, EMAIL], [EMAIL, FORECAST]):
        out = turn(m, text, tools, logit_bias=call_bias(m), max_new_tokens=8, call_sources=[text])
        calls = m.parser.parse(out, tools).calls
        assert calls and {c.name for c in calls} == {want}


@pytestmark_model
def test_a_forced_call_is_never_gated():
    m, text = model(), "Hello! How are you today?"
    out = turn(m, text, [FORECAST], force="get_forecast", call_sources=[text])
    [call] = m.parser.parse(out, [FORECAST]).calls
    assert call.name == "get_forecast"


def text_marker(start: str) -> HermesParser:
    """A Hermes parser whose call marker is `start`, a text of several tokens (as harmony's is, or a
    JSON opener): the gate cannot ban one special token, so it takes a call back once its marker
    is written."""
    return type("TextMarker", (HermesParser,), {"start": start})()


@pytestmark_model
def test_a_call_marker_of_several_tokens_is_taken_back_and_not_written_again():
    m, text = FreeTokenModel.from_pretrained(default_model()), "Hello!"
    m.parser = text_marker("\x00never written")
    free = turn(m, text, [FORECAST], constrain=False, max_new_tokens=12)
    marker = free[2:8]  # what the model writes anyway becomes a call's start
    assert len(m.tokenizer.encode(marker, add_special_tokens=False)) > 1
    m.parser = text_marker(marker)
    assert turn(m, text, [FORECAST], constrain=False, max_new_tokens=12) == free
    gated = turn(m, text, [FORECAST], constrain=False, max_new_tokens=12, call_sources=[text])
    assert marker not in gated and gated.startswith(free[:2]) and gated != free
    assert marker not in m.tokenizer.decode(m.token_ids)  # nor in the context


@pytestmark_model
def test_an_agent_gates_the_calls_the_model_decides_by_the_run_s_user_messages():
    called: list[str] = []

    def get_forecast(city: str) -> str:
        """The weather forecast for a city."""
        called.append(city)
        return "sunny"

    m = model()
    settings = {"logit_bias": call_bias(m)}
    agent = Agent(m, [tool(get_forecast)], max_steps=2, model_settings=settings, relevant_calls=True)
    # Ungated, the bias makes every turn call (the first test): this run would never end.
    result = agent.run("Hello! How are you today?")
    assert called == [] and result.trace.tool_calls == [] and result.output.strip()


def test_relevant_calls_are_the_embedded_model_s_default_only(tmp_path):
    from tiny_models import build_tiny_model

    assert model().relevant_calls and Agent(model()).relevant_calls
    assert not Agent(model(), relevant_calls=False).relevant_calls
    assert not FreeTokenModel.from_pretrained(default_model(), relevant_calls=False).relevant_calls
    other = FreeTokenModel.from_pretrained(build_tiny_model("qwen3_moe", tmp_path / "m"))
    assert not other.relevant_calls and not Agent(other).relevant_calls and other.trained_tools == frozenset()


def test_a_model_file_names_the_tools_it_was_trained_to_call(tmp_path):
    from tiny_models import build_tiny_model

    from freetoken_agents.engine.loading.convert import convert_checkpoint

    hf = build_tiny_model("qwen3_moe", tmp_path / "m")
    convert_checkpoint(hf, tmp_path / "m.ftw", progress=False, extra_metadata={"trained_tools": ["add", 3]})
    assert trained_tools(tmp_path / "m.ftw") == {"add"}  # names only
    assert trained_tools(hf) == frozenset()  # a checkpoint folder says nothing
    assert trained_tools(default_model()) == {"add", "multiply", "get_weather", "lookup_capital"}


@pytestmark_model
def test_chat_freetoken_gates_the_calls_the_model_decides_when_asked():
    from freetoken_agents.integrations.langchain import ChatFreeToken

    distance = schema("distance_between", "Get the distance between two places.", start="string")
    text = "Please email puzzle29@cherry.com, with high priority set to yes."  # no tool for that
    llm = ChatFreeToken(model=str(default_model()), relevant_calls=False)
    assert llm.bind_tools([distance]).invoke(text).tool_calls  # the model calls the one it has
    llm = ChatFreeToken(model=str(default_model()))  # the embedded model's default: gated
    msg = llm.bind_tools([distance]).invoke(text)
    assert msg.tool_calls == [] and msg.content.strip()


def test_bad_call_sources_or_metadata_are_refused_with_a_named_error(tmp_path):
    from pydantic import ValidationError
    from tiny_models import build_tiny_model

    from freetoken_agents.engine.loading.convert import convert_checkpoint

    with pytest.raises(ValidationError, match="call_sources"):
        GenerateRequest(tools=[FORECAST], call_sources="Forecast for Oslo?")  # one text, not a list
    hf = build_tiny_model("qwen3_moe", tmp_path / "m")
    with pytest.raises(ValueError, match="JSON-serialisable"):
        convert_checkpoint(hf, tmp_path / "m.ftw", progress=False, extra_metadata={"trained_tools": {1j}})
    assert not (tmp_path / "m.ftw").exists()
