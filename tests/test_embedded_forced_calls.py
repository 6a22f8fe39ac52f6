"""Forced tool calls and structured output on the REAL embedded model (the tiny trained Qwen3-MoE
shipped in freetoken_agents/data), through ChatFreeToken and the SDK: the arguments are the
request's values (regression: a schema compiled with sorted keys gave {'city': 'Paris, '} and
{'a': 133, 'b': 9245...})."""

from __future__ import annotations

import functools

import pytest
from pydantic import BaseModel

from freetoken_agents import FreeTokenModel, GenerateRequest, default_model
from freetoken_agents.integrations.langchain import ChatFreeToken
from freetoken_agents.recipes.tiny.world import get_weather, multiply

pytestmark = pytest.mark.usefixtures("one_thread")

# The model's own tools, exactly as it saw them in training (OpenAI function dicts).
GET_WEATHER, MULTIPLY = get_weather.json_schema(), multiply.json_schema()


@functools.cache
def llm() -> ChatFreeToken:
    return ChatFreeToken(model=str(default_model()))


@pytest.mark.parametrize("city", ["Paris", "Lisbon", "Madrid"])
def test_forced_get_weather_copies_the_city(city: str) -> None:
    msg = llm().bind_tools([GET_WEATHER], tool_choice="get_weather").invoke(f"What is the weather in {city}?")
    assert msg.invalid_tool_calls == []
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": city})]


def test_forced_get_weather_copies_osaka() -> None:
    """A vowel-initial city: the first shipped model (all training places consonant-initial) wrote
    'Fassaka'; the model trained on names with vowel onsets copies it."""
    msg = llm().bind_tools([GET_WEATHER], tool_choice="get_weather").invoke("What is the weather in Osaka?")
    assert msg.tool_calls[0]["args"] == {"city": "Osaka"}


def test_forced_multiply_copies_the_numbers() -> None:
    msg = llm().bind_tools([MULTIPLY], tool_choice="multiply").invoke("What is 12 times 7?")
    assert msg.invalid_tool_calls == []
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("multiply", {"a": 12, "b": 7})]


def test_with_structured_output_returns_a_clean_object() -> None:
    class Weather(BaseModel):
        city: str

    class Product(BaseModel):
        a: int
        b: int

    assert llm().with_structured_output(Weather).invoke("What is the weather in Paris?") == Weather(
        city="Paris"
    )
    assert llm().with_structured_output(Product).invoke("What is 12 times 7?") == Product(a=12, b=7)
    # The whole reply under the schema (a format the model was not trained on): still a valid object.
    raw = llm().with_structured_output(Weather, method="json_schema").invoke("What is the weather in Paris?")
    assert isinstance(raw, Weather)


def test_the_sdk_forced_call_agrees() -> None:
    model = FreeTokenModel(llm()._handle().engine)
    model.sync(model.render([{"role": "user", "content": "What is 12 times 7?"}], [MULTIPLY]))
    request = GenerateRequest(tools=[MULTIPLY], force="multiply")
    parsed = model.parser.parse("".join(e.text for e in model.generate(request) if e.kind == "text"))
    assert [(c.name, c.arguments) for c in parsed.calls] == [("multiply", {"a": 12, "b": 7})]
