"""Grounded arguments (freetoken_agents/grounding.py): plain string arguments decoded as spans of the
user's and the tools' text. The masking on a toy vocabulary, then the real embedded model through
the SDK, the Agent and ChatFreeToken."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from freetoken_agents import Agent, FreeTokenModel, GenerateRequest, default_model, tool
from freetoken_agents.grounding import (
    SpanGrounding,
    SpanIndex,
    conversation_sources,
    object_keys,
    schema_paths,
    sole_required_strings,
    tool_key_paths,
    tool_texts,
)
from freetoken_agents.named_values import key_words, mentions, namings
from freetoken_agents.parsers.base import name_args_schema

FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["city"],
        },
    },
}
PIECES = [
    *[b"Os", b"aka", b"eke", b'aka"}', b'"', b'"}', b"O", b"sa", b"ka", b"\\u6771", "東".encode(), b"x"],
    *[b"3", b"7", b"2", b"-", b".", b"0", b"}", b"2}", b", ", b"37", b" ", b"ink ", b"ink"],
    *[b"fahren", b"heit", b'heit"', b"celsius", b'celsius"'],
]
# Pieces that open a value with the white space before it, as a compact grammar's `": "` leaves them
OPENING = [*PIECES, b" -", b" 3", b' "', b'"Os', b' "Os', b' "eke', b'""', b"null"]


def grounding(sources: list[str], pieces: list[bytes] = PIECES) -> SpanGrounding:
    paths = schema_paths(name_args_schema([FORECAST]))
    return SpanGrounding(SpanIndex(pieces, skip=()), sources, *paths[:2], enum_paths=paths.enums)


def allowed(g: SpanGrounding, pieces: list[bytes] = PIECES) -> set[bytes]:
    return {pieces[i] for i in g.allowed()}


def test_only_plain_string_and_number_fields_are_grounded_not_the_name_unmentioned_enums_or_keys():
    strings, numbers, enums, booleans, integers = schema_paths(name_args_schema([FORECAST]))
    assert not booleans and integers == {(b"arguments", b"days")}
    assert strings == {(b"arguments", b"city"), (b"arguments", b"tags", b"*")}
    assert numbers == {(b"arguments", b"days")}
    assert enums == {(b"arguments", b"unit"): {"celsius", "fahrenheit"}}
    g = grounding(["Weather in Osaka?"])
    g.feed(b'{"name": "')
    assert not g.grounded  # the tool's name is a const, chosen by the grammar
    g.feed(b'get_forecast", "arguments": {"')
    assert not g.grounded  # a key
    g.feed(b'unit": "')
    assert not g.grounded  # an enum none of whose values the text mentions
    g.feed(b'celsius", "city": "')
    assert g.grounded
    g.feed(b'Osaka", "tags": ["')
    assert g.grounded
    g.feed(b'x"], "days": ')
    assert g.grounded == "start"  # where the number may start
    g.feed(b"3")
    assert g.grounded == "number"
    g.feed(b"}}")
    assert not g.grounded and g.stack == []


def test_a_grounded_value_only_grows_into_a_span_of_whole_words_of_a_source():
    g = grounding(["What is the weather like in Osaka?"])
    g.feed(b'{"name": "get_forecast", "arguments": {"city": "')
    assert allowed(g) == {b"Os", b"O", b'"', b'"}'}  # a word's start, or an empty value
    g.feed(b"Os")
    assert allowed(g) == {b"aka", b'aka"}'}  # "Oseke" is no span; "Os" is no whole word
    g.feed(b"aka")
    assert allowed(g) == {b'"', b'"}'}


def test_no_value_starts_with_a_lowercase_function_word_an_escape_s_letters_or_a_comma():
    """The embedded model wrote "me", "in notebook", "with" and "to" for values; a capitalised
    function word may start one ("The Hague"). In the ASCII-escaped form of "“castle saddle”" it
    wrote "u201d": the letters of the closing quote's escape."""
    pieces = [b"me", b"in", b"with", b"The", b" Hague", b"u201d", b"\\u201d", b",", b"castle", b'"']
    g = _source_grounding("Show me the Hague in The Hague, with “castle”", {"city": STRING}, pieces)
    g.feed(b'{"city": "')
    assert allowed(g, pieces) == {b"The", b"castle", b'"'}
    g.feed(b"The")
    assert b" Hague" in allowed(g, pieces)


def test_a_grounded_value_neither_starts_nor_ends_with_white_space():
    g = grounding(["weather ink Osaka"])
    g.feed(b'{"name": "get_forecast", "arguments": {"city": "')
    assert {b"ink", b"ink ", b"O", b"Os"} <= allowed(g) and b" " not in allowed(g)
    g.feed(b"ink")
    assert {b'"', b" "} <= allowed(g)  # "ink", or on to "ink Osaka"
    g.feed(b" ")
    assert b'"' not in allowed(g)  # not "ink "
    logits = torch.zeros(len(PIECES))
    g.restrict_(logits)
    assert {PIECES[i] for i in torch.nonzero(torch.isfinite(logits)).flatten().tolist()} == allowed(g)


def test_a_grounded_number_is_a_number_of_the_text_or_its_leading_digits():
    g = grounding(["Forecast for 372 days, or -2.0?"])
    g.feed(b'{"name": "get_forecast", "arguments": {"days": ')
    # 372's start, -2.0's sign ("2" and "7" start no number); white space before them, or
    # what opens no number (the grammar's to allow or not)
    assert allowed(g) & NUMBER_OPENERS == {b"3", b"37", b"-"}
    assert b" " in allowed(g)
    g.feed(b"37")
    assert allowed(g) == {b"2", b"2}"}  # 37 is no whole number: 372 it is
    g.feed(b"2")
    ends = {p for p in PIECES if p[0] not in b"-+.0123456789eE"}  # the grammar picks which
    assert allowed(g) == ends  # 372 ends there
    g = grounding(["Forecast for 372 days, or -2.0?"])
    g.feed(b'{"name": "get_forecast", "arguments": {"days": -2')
    assert allowed(g) == {b"."} | ends  # -2 or -2.0


NUMBER_OPENERS = {p for p in OPENING if p.lstrip()[:1] and p.lstrip()[0] in b"-+.0123456789eE"}


@pytest.mark.parametrize("prefix", [b":", b": "])
def test_a_value_is_grounded_from_the_piece_that_opens_it(prefix: bytes):
    """A compact grammar writes `": "` before a value, and a forced call's prefix may end at the
    colon: the piece that opens the value then carries the space (` -`, ` "Os`). It used to pass
    unmasked, and a value no source holds followed (the embedded model wrote -74 for "74")."""
    g = grounding(["Convert the temperature 74 for 3 days"], OPENING)
    g.feed(b'{"name": "get_forecast", "arguments": {"days"' + prefix)
    assert allowed(g, OPENING) & NUMBER_OPENERS == {b"3", b" 3", b"7"}  # not " -": no negative number
    g = grounding(["Weather in Osaka?"], OPENING)
    g.feed(b'{"name": "get_forecast", "arguments": {"city"' + prefix)
    openers = {p for p in allowed(g, OPENING) if p.lstrip().startswith(b'"')}
    assert openers == {b' "', b' "Os', b'"', b'"Os', b'""'}
    logits = torch.zeros(len(OPENING))
    g.restrict_(logits)
    assert not torch.isfinite(logits[OPENING.index(b' "eke')])
    assert torch.isfinite(logits[OPENING.index(b"null")])  # opens no string: the grammar decides
    g.feed(b' "Os')
    assert allowed(g, OPENING) == {b"aka", b'aka"}'}  # and it goes on as a span


def test_non_ascii_text_is_a_span_raw_or_escaped():
    g = grounding(["Weather in 東京"])
    g.feed(b'{"name": "get_forecast", "arguments": {"city": "')
    assert {"東".encode(), b"\\u6771"} <= allowed(g)


def test_where_no_span_fits_what_the_grammar_allows_the_grammar_decides_alone():
    g = grounding(["Weather in Osaka?"])
    g.feed(b'{"name": "get_forecast", "arguments": {"city": "')
    logits = torch.full((len(PIECES),), float("-inf"))
    logits[PIECES.index(b"x")] = 0.0  # the grammar allows only a token that is in no source
    g.restrict_(logits)
    assert torch.isfinite(logits[PIECES.index(b"x")])


def test_conversation_sources_are_the_user_and_tool_texts():
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Osaka?"}]},
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "tool", "content": '{"city": "Osaka"}'},
    ]
    assert conversation_sources(messages) == ["Weather in Osaka?", '{"city": "Osaka"}']


# ---- the real embedded model --------------------------------------------------------------------------
pytestmark_model = pytest.mark.usefixtures("one_thread")


@functools.cache
def model() -> FreeTokenModel:
    return FreeTokenModel.from_pretrained(default_model())


def forced_city(text: str, sources: list[str] | None) -> str:
    m = model()
    m.sync(m.render([{"role": "user", "content": text}], [FORECAST]))
    request = GenerateRequest(tools=[FORECAST], force="get_forecast", argument_sources=sources)
    out = "".join(e.text for e in m.generate(request) if e.kind == "text")
    (call,) = m.parser.parse(out, [FORECAST]).calls
    return call.arguments["city"]


@pytestmark_model
@pytest.mark.parametrize("text", ["What is the weather like in Osaka?", "Forecast for Ulaanbaatar, please."])
def test_a_grounded_forced_call_copies_a_span_of_the_request(text: str):
    city = forced_city(text, [text])
    assert city and city in text


CONVERT = {
    "type": "function",
    "function": {
        "name": "convert_temperature",
        "parameters": {
            "type": "object",
            "properties": {
                "degrees": {"type": "number"},
                "to_unit": {"type": "string", "enum": ["celsius", "kelvin"]},
            },
            "required": ["degrees"],
        },
    },
}


@pytestmark_model
@pytest.mark.parametrize(
    ("text", "degrees"),
    [
        ("Quick question: Please convert the temperature 74. Use the tool.", 74),
        ("Hey, can you convert 348 degrees?", 348),
    ],
)
def test_a_grounded_forced_number_is_one_the_request_writes(text: str, degrees: int):
    """The forced call's prefix ends at `"degrees":`; the embedded model opened the value with ` -`
    and wrote -74 and -48, numbers the request does not hold."""
    m = model()
    m.sync(m.render([{"role": "user", "content": text}], [CONVERT]))
    request = GenerateRequest(tools=[CONVERT], force="convert_temperature", argument_sources=[text])
    out = "".join(e.text for e in m.generate(request) if e.kind == "text")
    (call,) = m.parser.parse(out, [CONVERT]).calls
    assert str(call.arguments["degrees"]).removesuffix(".0") in text
    assert call.arguments["degrees"] >= 0


@pytestmark_model
def test_an_agent_grounds_its_calls_in_the_run_s_messages():
    seen: list[str] = []

    def get_forecast(city: str) -> str:
        """The weather forecast for a city."""
        seen.append(city)
        return json.dumps({"city": city, "forecast": "sunny"})

    agent = Agent(
        model(), tools=[tool(get_forecast)], tool_choice="get_forecast", max_steps=2, ground_arguments=True
    )
    text = "What will the weather be in Oyotunji tomorrow?"
    agent.run(text)
    assert seen and all(city and city in text for city in seen)


@pytestmark_model
def test_chat_freetoken_grounds_a_forced_call_when_asked():
    from freetoken_agents.integrations.langchain import ChatFreeToken

    text = "What is the weather like in Oyotunji?"
    llm = ChatFreeToken(model=str(default_model()), ground_arguments=True)
    msg = llm.bind_tools([FORECAST], tool_choice="get_forecast").invoke(text)
    assert msg.tool_calls[0]["args"]["city"] == "Oyotunji"


def test_grounding_is_the_embedded_model_s_default_only(tmp_path):
    from tiny_models import build_tiny_model

    assert model().ground_arguments
    assert Agent(model()).ground_arguments and not Agent(model(), ground_arguments=False).ground_arguments
    assert not FreeTokenModel.from_pretrained(default_model(), ground_arguments=False).ground_arguments
    other = FreeTokenModel.from_pretrained(build_tiny_model("qwen3_moe", tmp_path / "m"))
    assert not other.ground_arguments and not Agent(other).ground_arguments


def test_a_quoted_value_is_copied_whole_or_not_at_all():
    """'Osaka ink' is quoted: a span from its first character ends at its closing quote (not at
    "Osaka", a whole word), and no span starts inside it (its "ink"); outside it, words as usual."""
    g = grounding(["ink 'Osaka ink' now"])
    g.feed(b'{"name": "get_forecast", "arguments": {"city": "')
    assert b"ink" in allowed(g)  # the first word, outside the quotes
    g.feed(b"Osaka")
    assert allowed(g) == {b" "}  # no closing after "Osaka": the quoted value goes on
    g.feed(b" ink")
    assert allowed(g) == {b'"', b'"}'}  # it ends at its quote, and not past it
    g = grounding(["ink 'Osaka ink' now"])
    g.feed(b'{"name": "get_forecast", "arguments": {"city": "Osaka ')
    assert allowed(g) == {b"ink"}  # still the quoted value, to its end
    g = grounding(["ink 'Osaka ink' now, ink Osaka"])  # outside the quotes "Osaka" is a whole word
    g.feed(b'{"name": "get_forecast", "arguments": {"city": "Osaka')
    assert {b" ", b'"', b'"}'} <= allowed(g)


def test_no_span_runs_into_a_quoted_value_it_did_not_start_at():
    """The embedded model wrote "playlist called 'ブチュヸゾギ" for a name quoted as 'ブチュヸゾギ'
    (a span from before the opening quote ended at the closing one), and "translate 'dragon marble
    honey silver' (" for 'dragon marble honey silver'."""
    g = grounding(["ink 'Osaka ink' now"])
    g.feed(b'{"name": "get_forecast", "arguments": {"city": "ink')
    assert allowed(g) == {b'"', b'"}'}  # "ink" ends before the quote: the quoted value is its own


def test_a_quote_that_is_an_apostrophe_quotes_nothing():
    g = grounding(["don't go to Osaka's port"])
    g.feed(b'{"name": "get_forecast", "arguments": {"city": "Os')
    assert b"aka" in allowed(g)  # "Osaka" is a word of its own, not inside a quote


def test_an_enum_the_text_mentions_takes_a_mentioned_value():
    g = grounding(["Forecast for Osaka in Fahrenheit"])
    g.feed(b'{"name": "get_forecast", "arguments": {"unit": "')
    assert g.grounded == "enum" and allowed(g) == {b"fahren"}  # case aside, whole words
    g.feed(b"fahren")
    assert allowed(g) == {b"heit", b'heit"'}
    g = grounding(["Forecast for Osaka, celsius or fahrenheit?"])
    g.feed(b'{"name": "get_forecast", "arguments": {"unit": "')
    assert allowed(g) == {b"fahren", b"celsius", b'celsius"'}  # either, the model chooses
    g = grounding(["Forecast for Osaka, celsiusish"])  # no whole word: the grammar alone
    g.feed(b'{"name": "get_forecast", "arguments": {"unit": "')
    assert not g.grounded


def test_an_unbalanced_quote_quotes_nothing():
    """An untrusted text with a quote never closed (or only closed inside a word) restricts no
    span: "Osaka" stays a whole word to copy."""
    for text in ["in 'Osaka now", "in 'Osaka isn'tso", "'" * 1000 + " in Osaka"]:
        g = grounding([text])
        g.feed(b'{"name": "get_forecast", "arguments": {"city": "Osaka')
        assert {b'"', b'"}'} <= allowed(g), text


NAMING_PIECES = [*OPENING, b"Ky", b"oto", b'oto"', b"days", b"city", b" =", b" days", b"Quick"]


def test_a_value_the_text_names_by_its_parameter_starts_where_the_text_writes_it():
    """`days = 2` names the value of `days`: 372 (a number of the text) no longer starts it; a
    quoted naming starts past its quote and ends at it; a parameter's words ("days" of a
    `num_days`) name it too."""
    g = grounding(["Forecast for 372 days, days = 2"], NAMING_PIECES)
    g.feed(b'{"name": "get_forecast", "arguments": {"days": ')
    assert allowed(g, NAMING_PIECES) & NUMBER_OPENERS == {b"2", b"2}"}
    g = grounding(["Weather in Osaka, city='Kyoto' please"], NAMING_PIECES)
    g.feed(b'{"name": "get_forecast", "arguments": {"city": "')
    assert allowed(g, NAMING_PIECES) == {b"Ky"}  # not "Os", "in", nor an empty value
    g.feed(b"Ky")
    assert allowed(g, NAMING_PIECES) == {b"oto", b'oto"'}
    schema = {
        "type": "object",
        "properties": {"num_days": {"type": "integer"}, "city": {"type": "string"}},
    }
    paths = schema_paths(schema)
    g = SpanGrounding(SpanIndex(NAMING_PIECES, skip=()), ["Forecast for 372, num days: 2"], *paths[:2])
    g.feed(b'{"num_days": ')
    assert allowed(g, NAMING_PIECES) & NUMBER_OPENERS == {b"2", b"2}"}


def test_no_span_runs_into_a_naming():
    """The embedded model wrote "Kitu unit =" for a start in "from Kitu unit = km": a span that
    starts before a parameter's naming ends before it, and none starts inside it."""
    g = grounding(["Weather in Osaka days = 3"], NAMING_PIECES)
    g.feed(b'{"name": "get_forecast", "arguments": {"city": "')
    assert b"days" not in allowed(g, NAMING_PIECES)  # the naming's own word starts no value
    g.feed(b"Osaka")
    assert b'"' in allowed(g, NAMING_PIECES) and b" " not in allowed(g, NAMING_PIECES)  # not " days ="


def test_a_naming_that_no_piece_can_follow_or_inside_a_quote_restricts_nothing():
    g = grounding(["Weather ink Osaka, city: Kyoto"])  # no piece writes "Kyoto"
    g.feed(b'{"name": "get_forecast", "arguments": {"city": "')
    assert {b"Os", b"ink"} <= allowed(g)  # the spans of the text, as without the naming
    g = grounding(["Weather in 'Osaka days: 3' now"], NAMING_PIECES)  # a quoted value's own text
    g.feed(b'{"name": "get_forecast", "arguments": {"city": "Osaka days')
    assert b":" not in allowed(g, NAMING_PIECES) and allowed(g, NAMING_PIECES) == set()
    g = grounding(["Weather in 'Osaka days: 3' now"], NAMING_PIECES)
    g.feed(b'{"name": "get_forecast", "arguments": {"city": "')
    assert b"Os" in allowed(g, NAMING_PIECES)  # the quoted value is still one to copy whole


def function_tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    """An OpenAI-style tool schema of an object of `properties`."""
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


STRING, BOOLEAN = {"type": "string"}, {"type": "boolean"}
STOCK = function_tool(
    "stock_quote",
    "Get the latest stock price for a ticker.",
    {"ticker": STRING, "currency": STRING},
    ["ticker", "currency"],
)
PLAYLIST = function_tool(
    "new_playlist",
    "Create a music playlist.",
    {"playlist_name": STRING, "public": BOOLEAN},
    ["playlist_name", "public"],
)
ROOM = function_tool(
    "reserve_room", "Book a hotel room in a city.", {"city": STRING, "breakfast": BOOLEAN}, ["city"]
)
EMAIL = function_tool(
    "email_send",
    "Send an email.",
    {"recipient": STRING, "subject": STRING, "high_priority": BOOLEAN},
    ["recipient"],
)
NEW_PLAYLIST = function_tool(
    "new_playlist", "Create a music playlist.", {"playlist_name": STRING}, ["playlist_name"]
)
UNIT = {"type": "string", "enum": ["km", "miles"]}
DISTANCE = function_tool(
    "get_distance", "Get the distance between two places.", {"start": STRING, "unit": UNIT}, ["start", "unit"]
)
ROUTE = function_tool(
    "route_length", "Get the distance between two places.", {"start": STRING, "unit": UNIT}, ["start"]
)
TEMPERATURE_UNIT = {"type": "string", "enum": ["celsius", "fahrenheit", "kelvin"]}
TEMP_CONVERT = function_tool(
    "temp_convert",
    "Convert a temperature between units.",
    {"value": {"type": "number"}, "from_unit": TEMPERATURE_UNIT, "to_unit": TEMPERATURE_UNIT},
    ["value"],
)
MEETING = function_tool("book_meeting", "Schedule a meeting.", {"title": STRING, "date": STRING}, ["title"])
MEETING_WANT = {"title": "candle guitar", "date": "2027-10-17"}
TRANSLATE = function_tool(
    "translate_text",
    "Translate text into another language.",
    {"source_text": STRING, "target_language": {"type": "string", "enum": ["spanish", "japanese"]}},
    ["source_text"],
)
QUOTE = function_tool(
    "stock_quote", "Get the latest stock price for a ticker.", {"symbol": STRING}, ["symbol"]
)
LETTERS = function_tool(
    "letter_counter", "Count how many times a letter appears in a word.", {"text": STRING}, ["text"]
)
HOTEL = function_tool(
    "book_hotel",
    "Book a hotel room in a city.",
    {"location": STRING, "nights": {"type": "integer"}, "breakfast": BOOLEAN},
    ["location"],
)
BMI = function_tool(
    "compute_bmi",
    "Compute the body mass index.",
    {"weight": {"type": "number"}, "height_cm": {"type": "integer"}},
    ["weight"],
)
LOCAL_TIME = function_tool(
    "local_time", "Tell the local time and time zone of a city.", {"location": STRING}, ["location"]
)
ROOM_OBJECT = {
    "type": "object",
    "properties": {"building": STRING, "floor": {"type": "integer"}},
    "required": ["building", "floor"],
}
MEETING_ROOM = function_tool(
    "book_meeting",
    "Schedule a meeting in the calendar.",
    {"title": STRING, "room": ROOM_OBJECT},
    ["title", "room"],
)
SHARE_PRICE = function_tool(
    "fetch_share_price", "Get the latest stock price for a ticker.", {"ticker": STRING}, ["ticker"]
)
TRIP = function_tool(
    "distance_between",
    "Get the distance between two places.",
    {"start": STRING, "destination": STRING},
    ["start", "destination"],
)
KROTRIFEN = function_tool(
    "krotrifen_op",
    "Apply the krotrifen function to an input.",
    {"value": {"type": "integer"}, "factor": {"type": "integer"}},
    ["value", "factor"],
)
QUOTE_CURRENCY = function_tool(
    "stock_quote",
    "Get the latest stock price for a ticker.",
    {"symbol": STRING, "currency": STRING},
    ["symbol"],
)
CALENDAR = function_tool(
    "book_meeting",
    "Schedule a meeting.",
    {"title": STRING, "date": STRING, "duration_minutes": {"type": "integer"}},
    ["title"],
)
TRIMEL = function_tool(
    "trimel_tool",
    "Apply the trimel function to an input.",
    {"x": {"type": "number"}, "offset": {"type": "integer"}},
    ["x", "offset"],
)


@pytestmark_model
@pytest.mark.parametrize(
    ("text", "schema", "want"),
    [
        (
            "Quick question: Please check the share price for RKI currency = GBP.",
            STOCK,
            {"ticker": "RKI", "currency": "GBP"},
        ),
        (
            "Hi! What does new_playlist(playlist_name='隡烬龰', public=False) return?",
            PLAYLIST,
            {"playlist_name": "隡烬龰", "public": False},
        ),
        (
            "Hi! What is the value of reserve_room(city='Urbika', breakfast=True)? Thanks!",
            ROOM,
            {"city": "Urbika", "breakfast": True},
        ),
        (
            "With the email_send tool, send an email to zebra94@mountain.com. Please use a tool.",
            EMAIL,
            {"recipient": "zebra94@mountain.com"},
        ),
        ("Now make a new playlist called 'ブチュヸゾギ'.", NEW_PLAYLIST, {"playlist_name": "ブチュヸゾギ"}),
        ("Tell me the stock price of SZ, currency GBP.", STOCK, {"ticker": "SZ", "currency": "GBP"}),
        (
            "I would like to know the distance from Gerbun, unit: miles.",
            DISTANCE,
            {"start": "Gerbun", "unit": "miles"},
        ),
        ("With the trimel_tool tool, apply trimel to -33.3, offset: 94.", TRIMEL, {"x": -33.3, "offset": 94}),
        ("Look up how far it is from Kitu unit = km. Use the tool.", ROUTE, {"start": "Kitu", "unit": "km"}),
        (
            "Hi! What does temp_convert(value=351, from_unit='fahrenheit', to_unit='celsius') return?",
            TEMP_CONVERT,
            {"value": 351, "from_unit": "fahrenheit", "to_unit": "celsius"},
        ),
        ("Hey, schedule a meeting about 'candle guitar' date = 2027-10-17.", MEETING, MEETING_WANT),
        (
            "Hello. Please translate 'dragon marble honey silver' (Hello Group).",
            TRANSLATE,
            {"source_text": "dragon marble honey silver"},
        ),
        (
            "Go ahead and put a meeting called 'Sustimses Systems' in the calendar. Please use a tool.",
            CALENDAR,
            {"title": "Sustimses Systems"},
        ),
        ("Get the stock price of JWFPH. Thanks!", QUOTE, {"symbol": "JWFPH"}),
        ("Get how often a letter appears in naïve. Thank you.", LETTERS, {"text": "naïve"}),
        (
            "Go ahead and book a hotel in Vurbren nights = 27, breakfast: yes. Use the tool.",
            HOTEL,
            {"location": "Vurbren", "nights": 27, "breakfast": True},
        ),
        (
            "Go ahead and create a playlist named 'Omtroum Studio' with public set to on. Use the tool.",
            PLAYLIST,
            {"playlist_name": "Omtroum Studio", "public": True},
        ),
        ("Call compute_bmi(66.7). - a small technology company", BMI, {"weight": 66.7}),
        (
            "Hey, could you find out the time zone of Ilpekrar for me? - a small technology company",
            LOCAL_TIME,
            {"location": "Ilpekrar"},
        ),
        (
            "Call book_meeting and schedule a meeting about 'Vumbrous Labs' with room building café and"
            " floor 27. Use the tool.",
            MEETING_ROOM,
            {"title": "Vumbrous Labs", "room": {"building": "café", "floor": 27}},
        ),
        (
            "Quick question: Tell me the share price for UJF. Please use a tool.",
            SHARE_PRICE,
            {"ticker": "UJF"},
        ),
        (
            "Hey, show me how far it is from Firtailsen destination = Saint Stakaiva.",
            TRIP,
            {"start": "Firtailsen", "destination": "Saint Stakaiva"},
        ),
        ("Hey, could you apply krotrifen to 53 factor -32?", KROTRIFEN, {"value": 53, "factor": -32}),
        (
            "Find the share price for PSRTP currency CHF. Thank you.",
            QUOTE_CURRENCY,
            {"symbol": "PSRTP", "currency": "CHF"},
        ),
    ],
)
def test_a_grounded_forced_call_takes_the_values_the_request_names(text: str, schema: dict, want: dict):
    """Held-out requests of the generic evaluation on the embedded model: it wrote a ticker of
    "RKI currency" (running into the naming of `currency`), a playlist name of
    "playlist_name='隡烬龰', public=False) return?" (a span from before the naming) and
    breakfast false for `breakfast=True`; then "zebra94" (an address cut at its @), "playlist
    called 'ブチュヸゾギ'." (a span running into a quoted value), "SZ, currency GBP" (into a
    parameter's bare name), "Gerbun," (ending on a comma) and an x of 94.3 (the offset's 94); then
    no unit for "unit = km" (an optional key the text names) and fahrenheit for both units; then
    a title of "meeting about" where the request quotes 'candle guitar'; then optional keys no
    word of the request mentions (a target language, a date of "tool"); then values from the
    tool's own words ("stock", "how often a letter"); then no `nights` where "nights = 27" comes
    before "breakfast: yes" (the later named key written first, which left it out), public false
    for "public set to on", and a weight of 66 for "compute_bmi(66.7)"; then a location of
    "Ilpekrar for" (a name run on into the request's prose); then a building of "Vumbrous Labs"
    for "with room building café and floor 27" (a nested parameter listed after its object's name,
    and the next one after "and"); then "UJF. Please use a tool." and "Saint Stakaiva." (a value
    run past the end of its sentence, or taking its full stop); then a factor of 53 for "to 53
    factor -32" (a parameter's bare name before a number names it), and no currency for "PSRTP
    currency CHF" (nor before a code in capitals)."""
    m = model()
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": text},
    ]
    m.sync(m.render(messages, [schema]))
    name = schema["function"]["name"]
    request = GenerateRequest(tools=[schema], force=name, argument_sources=[text])
    out = "".join(e.text for e in m.generate(request) if e.kind == "text")
    (call,) = m.parser.parse(out, [schema]).calls
    assert call.arguments == want


def test_a_parameter_is_named_by_its_name_or_its_words_then_equals_colon_or_set_to():
    assert key_words("duration_minutes") == ["duration_minutes", "duration minutes"]
    assert key_words("maxResults") == ["maxResults", "max results"]
    assert key_words("city") == ["city"]
    text = b"Kitu unit = km, Max Results:5, f(city='Osaka'), the unit is km, days ="
    found = namings(text, ["unit", "maxResults", "city", "days"], [b"'"])
    assert [(n.key, text[n.start : n.value]) for n in found] == [
        ("unit", b"unit = "),
        ("maxResults", b"Max Results:"),
        ("city", b"city='"),
    ]  # not prose ("the unit is km"), nor a naming with no value after it
    text = b"nights 27 and factor -32 for the 3 days of the trip"
    found = namings(text, ["nights", "factor", "days", "trip"], [b"'"])
    assert [(n.key, text[n.start : n.value]) for n in found] == [
        ("nights", b"nights "),
        ("factor", b"and factor "),
    ]  # a bare name before a number names it; "3 days" does not
    text = b"PSRTP currency CHF; the unit km; a code Xy"
    assert [n.key for n in namings(text, ["currency", "unit", "code"], [b"'"])] == ["currency"]
    text = b"with public set to on, breakfast Set To no; the unit set km"
    found = namings(text, ["public", "breakfast", "unit"], [b"'"])
    assert [(n.key, text[n.start : n.value]) for n in found] == [
        ("public", b"public set to "),
        ("breakfast", b"breakfast Set To "),
    ]


def test_a_parameter_is_named_by_a_quoted_value_a_list_or_named_called_titled():
    text = (
        b"Create a customer named 'Acme' with email a@b.co, SZ, currency GBP, subject 'Q3', the book"
        b" titled Dune, a letter appears"
    )
    keys = ["customer_name", "email", "currency", "subject", "title", "letter"]
    found = namings(text, keys, [b"'"])
    assert [(n.key, text[n.start : n.value]) for n in found] == [
        ("customer_name", b"named '"),  # the word before "named" is the parameter's
        ("email", b"with email "),  # listed after "with", which starts the naming
        ("currency", b"currency "),  # listed after a comma
        ("subject", b"subject '"),  # a quoted value
        ("title", b"titled "),  # the one parameter that is a title
    ]  # "a letter appears" names nothing
    assert [text[k:].split()[0] for k in mentions(text, keys)] == [
        b"email",
        b"currency",
        b"subject",
        b"letter",
    ]
    # "named" with two parameters that are names, neither the word before it: nothing is named
    assert namings(b"a person named Bo", ["first_name", "last_name"], [b"'"]) == []
    # Listed after "and", or after the name of the object holding it (a nested parameter)
    text = rb"with room building caf\u00e9 and floor 27, a building block"
    found = namings(text, ["building", "floor"], [b"'"], containers=["arguments", "room"])
    assert [(n.key, text[n.start : n.value]) for n in found] == [
        ("building", b"building "),
        ("floor", b"and floor "),
    ]
    assert [n.key for n in namings(text, ["building", "floor"], [b"'"])] == ["floor"]
    # A parameter named by a function word is not found by its bare name: "Trip to Paris" is whole.
    text = b"Email bob@x.co, with subject Trip to Paris, to tell him"
    assert mentions(text, ["to", "subject"]) == [text.index(b"subject")]
    assert [n.key for n in namings(text, ["to", "subject"], [b"'"])] == ["subject"]
    pieces = [b"Trip", b" to", b" Paris", b'"', b","]
    g = _source_grounding(text.decode(), {"to": STRING, "subject": STRING}, pieces)
    g.feed(b'{"subject": "Trip to')
    assert b" Paris" in allowed(g, pieces)  # no wall at "to"


def _source_grounding(text: str, properties: dict, pieces: list[bytes]) -> SpanGrounding:
    paths = schema_paths({"type": "object", "properties": properties})
    return SpanGrounding(
        SpanIndex(pieces, skip=()), [text], *paths[:2], enum_paths=paths.enums, boolean_paths=paths.booleans
    )


def test_an_email_address_is_copied_whole():
    """The embedded model wrote "banana91" and "kitten17@engine" for banana91@feather.com and
    kitten17@engine.com."""
    pieces = [b"banana91", b"@feather", b".com", b"feather", b'"', b"please"]
    g = _source_grounding("Email banana91@feather.com, please", {"note": STRING}, pieces)
    g.feed(b'{"note": "')
    assert {b"banana91", b"please"} <= allowed(g, pieces) and b"feather" not in allowed(g, pieces)
    g.feed(b"banana91")
    assert allowed(g, pieces) == {b"@feather"}
    g.feed(b"@feather")
    assert allowed(g, pieces) == {b".com"}
    g.feed(b".com")
    assert allowed(g, pieces) == {b'"'}  # the address ends before its comma


@pytest.mark.parametrize("key", ["to", "recipient", "email_address", "cc"])
def test_an_address_parameter_takes_an_address_the_text_writes(key: str):
    """Held-out requests on the embedded model: "Use mail_message to email guitar7@letter.com"
    gave a `to` of "mail_message to", and "Send an email to pencil96@kitten.com, please. Please
    use a tool." a recipient of "use". A parameter named as an address takes one the text writes;
    other parameters may not start there."""
    pieces = [b"pencil96", b"@kitten", b".com", b"use", b"Send", b'"']
    text = "Send an email to pencil96@kitten.com, please. Please use a tool."
    g = _source_grounding(text, {key: STRING, "subject": STRING}, pieces)
    g.feed(b'{"' + key.encode() + b'": "')
    assert allowed(g, pieces) == {b"pencil96"}
    g.feed(b'pencil96@kitten.com", "subject": "')
    assert b"pencil96" not in allowed(g, pieces) and b"Send" in allowed(g, pieces)
    g = _source_grounding("Send an email, please", {key: STRING}, pieces)  # no address: any span
    g.feed(b'{"' + key.encode() + b'": "')
    assert b"Send" in allowed(g, pieces)


def test_a_value_ends_before_a_parameter_s_name_and_not_on_a_comma():
    """ "SZ, currency GBP": the ticker stops before "currency" and does not end on the comma (nor
    is it written on into the comma, where it could end nowhere), and the currency is GBP."""
    pieces = [b"SZ", b",", b", ", b'"', b"currency", b"GBP", b"Price"]
    properties = {"ticker": STRING, "currency": STRING, "note": STRING}
    g = _source_grounding("Price of SZ, currency GBP.", properties, pieces)
    g.feed(b'{"ticker": "SZ')
    assert allowed(g, pieces) == {b'"'}
    g.feed(b'", "currency": "')
    assert allowed(g, pieces) == {b"GBP"}  # named by the list
    g.feed(b'GBP", "note": "')
    assert {b"Price", b"SZ"} <= allowed(g, pieces)
    pieces = [b"bob", b"high", b" priority", b'"']  # the embedded model wrote "high priority no"
    g = _source_grounding("Email bob high priority no", {"to": STRING, "high_priority": BOOLEAN}, pieces)
    g.feed(b'{"to": "')
    assert allowed(g, pieces) == {b"bob", b'"'}  # an empty value, or bob: a parameter's name is no value


def test_a_value_the_text_names_for_one_parameter_is_not_another_s():
    """ "apply trimel to -33.3, offset: 94": the embedded model wrote an x of 94.3."""
    pieces = [b" -", b"-", b"33", b".3", b" 94", b"94", b"9", b"4", b"}"]
    properties = {"x": {"type": "number"}, "offset": {"type": "integer"}}
    g = _source_grounding("apply trimel to -33.3, offset: 94", properties, pieces)
    g.feed(b'{"x":')
    assert {b" -", b"-"} <= allowed(g, pieces) and not {b" 94", b"94", b"9"} & allowed(g, pieces)
    g.feed(b' -33.3, "offset":')
    assert {b" 94", b"94", b"9"} <= allowed(g, pieces) and not {b" -", b"-"} & allowed(g, pieces)


def _finite(logits: torch.Tensor, pieces: list[bytes]) -> set[bytes]:
    return {pieces[i] for i in torch.nonzero(torch.isfinite(logits)).flatten().tolist()}


def test_a_call_does_not_close_without_a_key_the_text_names_nor_guess_another_key_first():
    """Held-out requests on the embedded model: "from Kitu unit = km" gave {"start": "Kitu"} and
    "a meeting about 'X' duration minutes: 13" a guessed room. Keys follow the schema's order, so
    before the named key only it may be written, and the object closes once it is."""
    pieces = [b"Kitu", b'"', b'"}', b"}", b", ", b'"room', b'"unit', b'": ', b"km", b'km"}', b'"un', b"it"]
    properties = {"start": STRING, "room": STRING, "unit": {"type": "string", "enum": ["km", "miles"]}}
    g = _source_grounding("How far is it from Kitu unit = km", properties, pieces)
    g.feed(b'{"start": "Kitu')
    logits = torch.zeros(len(pieces))
    g.restrict_(logits)
    assert b'"' in _finite(logits, pieces) and b'"}' not in _finite(logits, pieces)  # it misses the unit
    g.feed(b'", ')
    logits = torch.zeros(len(pieces))
    g.restrict_(logits)
    assert {b'"unit', b'"un'} <= _finite(logits, pieces) and not {b'"room', b"}"} & _finite(logits, pieces)
    g.feed(b'"unit": "km')
    logits = torch.zeros(len(pieces))
    g.restrict_(logits)
    assert {b'"', b'"}'} <= _finite(logits, pieces)  # every named key written: it may close
    # Nothing named: any key, and the object may close at once.
    g = _source_grounding("How far is it from Kitu", properties, pieces)
    g.feed(b'{"start": "Kitu')
    logits = torch.zeros(len(pieces))
    g.restrict_(logits)
    assert b'"}' in _finite(logits, pieces)


def test_a_key_named_for_one_tool_is_not_asked_of_another_tool_s_call():
    """With several tools offered the key paths are every tool's: "unit = km" names ROUTE's unit,
    and a call of another tool, which has no unit, must still be able to close."""
    pieces = [b"Kitu", b'"', b'"}', b'"}}', b", ", b'"days', b'"unit']
    other = function_tool(
        "forecast", "The weather.", {"start": STRING, "days": {"type": "integer"}}, ["start"]
    )
    schema = name_args_schema([ROUTE, other])
    paths = schema_paths(schema)
    index = SpanIndex(pieces, skip=())
    text = ["From Kitu unit = km"]

    def closing_after_start(tool: str) -> bool:
        g = SpanGrounding(index, text, *paths[:2], enum_paths=paths.enums, tool_paths=tool_key_paths(schema))
        g.feed(b'{"name": "' + tool.encode() + b'", "arguments": {"start": "Kitu')
        logits = torch.zeros(len(pieces))
        g.restrict_(logits)
        return bool({b'"}', b'"}}'} & _finite(logits, pieces))

    assert not closing_after_start("route_length")
    assert closing_after_start("forecast")


def test_the_one_required_string_takes_the_one_value_the_text_quotes():
    """Held-out requests on the embedded model: "schedule a meeting about 'candle guitar'" gave a
    title of "meeting about", "what the web says about "coffee"" a query of "says about". A tool's
    one required plain string takes the text's one quoted value that no naming claims; a tool
    with two (an origin and a destination) is left to the model, and so are its other strings."""
    pieces = [b"meeting", b"candle", b" guitar", b"'", b'"', b"Paris", b"2027"]
    text = ["Hey, schedule a meeting about 'candle guitar' in Paris on 2027"]

    def allowed_for(properties: dict, required: list[str], key: str) -> set[bytes]:
        schema = name_args_schema([function_tool("book", "Book it.", properties, required)])
        paths = schema_paths(schema)
        g = SpanGrounding(
            SpanIndex(pieces, skip=()), text, *paths[:2], sole_required=sole_required_strings(schema)
        )
        g.feed(b'{"name": "book", "arguments": {"' + key.encode() + b'": "')
        return allowed(g, pieces)

    assert allowed_for({"title": STRING, "city": STRING}, ["title"], "title") == {b"candle"}
    assert {b"meeting", b"Paris"} <= allowed_for({"title": STRING, "city": STRING}, ["title"], "city")
    two = {"origin": STRING, "destination": STRING}
    assert {b"meeting", b"candle", b"Paris"} <= allowed_for(two, ["origin", "destination"], "origin")
    assert sole_required_strings(name_args_schema([MEETING])) == {b"book_meeting": (b"arguments", b"title")}
    assert sole_required_strings(name_args_schema([TEMP_CONVERT])) == {}  # no required string


def test_a_schema_that_is_no_call_has_no_tools_even_with_a_property_named_name():
    """A tool whose body schema is its parameters (no name/arguments wrapper) may have a parameter
    "name" whose schema is `true`: reading the tools of the schema raised AttributeError."""
    schema = {"type": "object", "properties": {"name": True, "city": STRING}, "required": ["city"]}
    assert tool_key_paths(schema) == {}
    assert sole_required_strings(schema) == {None: (b"city",)}
    call = name_args_schema([MEETING])
    assert tool_key_paths(call)[b"book_meeting"] >= {(b"arguments",), (b"arguments", b"title")}


def test_an_enum_the_text_names_takes_the_value_named_not_another_it_mentions():
    """ "temp_convert(value=351, from_unit='fahrenheit', to_unit='celsius')": the embedded model
    wrote fahrenheit for both units; both are mentioned, each named for one."""
    pieces = [b"fahrenheit", b"celsius", b'"', b"fa", b"cel"]
    unit = {"type": "string", "enum": ["celsius", "fahrenheit", "kelvin"]}
    text = "What does temp_convert(value=351, from_unit='fahrenheit', to_unit='celsius') return?"
    g = _source_grounding(text, {"from_unit": unit, "to_unit": unit}, pieces)
    g.feed(b'{"from_unit": "')
    assert allowed(g, pieces) == {b"fahrenheit", b"fa"}
    g.feed(b'fahrenheit", "to_unit": "')
    assert allowed(g, pieces) == {b"celsius", b"cel"}
    g = _source_grounding("Convert to celsius from fahrenheit", {"to_unit": unit}, pieces)
    g.feed(b'{"to_unit": "')
    assert {b"fahrenheit", b"celsius"} <= allowed(g, pieces)  # mentioned, named for no unit


BOOLEAN_PIECES = [b" true", b" false", b"tr", b"ue", b"f", b"true}", b"false,", b" ", b"null", b" t"]


@pytest.mark.parametrize(
    ("text", "wanted"),
    [
        ("Call new_playlist(name='Jazz', public=False)", {b" false", b"f", b"false,"}),
        ("A playlist, public: yes", {b" true", b"tr", b"true}", b" t"}),
        ("A playlist, high priority: off, public = ON", {b" true", b"tr", b"true}", b" t"}),
        ("Create a playlist named 'Jazz' public on, genre: rock", {b" true", b"tr", b"true}", b" t"}),
        ("A playlist public no", {b" false", b"f", b"false,"}),
    ],
)
def test_a_boolean_the_text_names_takes_the_truth_it_names(text: str, wanted: set[bytes]):
    """Named by `=` or `:`, or by its bare name then a truth word: the embedded model wrote false
    for "reserve a room in Uthnurkrith, NSW breakfast on" and "a playlist named 'X' public on"."""
    schema = {
        "type": "object",
        "properties": {"public": {"type": "boolean"}, "high_priority": {"type": "boolean"}},
    }
    paths = schema_paths(schema)
    assert paths.booleans == {(b"public",), (b"high_priority",)}
    g = SpanGrounding(SpanIndex(BOOLEAN_PIECES, skip=()), [text], *paths[:2], boolean_paths=paths.booleans)
    g.feed(b'{"public":')
    assert g.grounded == "boolean"
    assert {BOOLEAN_PIECES[i] for i in g.allowed()} == wanted
    logits = torch.zeros(len(BOOLEAN_PIECES))
    g.restrict_(logits)
    if "high priority" in text:  # named too: `true}` would close the call without it
        wanted = wanted - {b"true}"}
    assert {BOOLEAN_PIECES[i] for i in torch.nonzero(torch.isfinite(logits)).flatten().tolist()} == wanted


def test_a_boolean_named_both_ways_or_not_at_all_is_the_grammar_s():
    schema = {"type": "object", "properties": {"public": {"type": "boolean"}}}
    paths = schema_paths(schema)
    for text in ["public: yes, or public: no?", "a public playlist", "public is true"]:
        g = SpanGrounding(
            SpanIndex(BOOLEAN_PIECES, skip=()), [text], *paths[:2], boolean_paths=paths.booleans
        )
        g.feed(b'{"public":')
        assert g.grounded is None, text


def test_no_value_starts_on_a_lowercase_word_of_the_tool_s_own_name_or_description():
    """ "Get the stock price of JWFPH" gave a symbol of "stock", and "how often a letter appears
    in naïve" a text of "how often a letter": the request's words that name the tool are no value.
    A capitalised word may start one (a name), and where the value can start nowhere else the
    tool's words are allowed (nothing is lost)."""
    pieces = [b"stock", b"Stock", b"JWFPH", b"price", b'"']
    schema = {"type": "object", "properties": {"symbol": STRING}}
    paths = schema_paths(schema)
    texts = tool_texts([QUOTE])

    def opening(text: str) -> set[bytes]:
        g = SpanGrounding(SpanIndex(pieces, skip=()), [text], *paths[:2], tool_texts=texts)
        g.feed(b'{"symbol": "')
        return allowed(g, pieces)

    assert texts == {
        b"stock_quote": "stock_quote Get the latest stock price for a ticker.",
        None: texts[b"stock_quote"],
    }
    assert opening("Get the stock price of JWFPH") == {b"JWFPH", b'"'}
    assert b"Stock" in opening("Stock price of JWFPH")
    assert opening("stock price") >= {b"stock"}  # no other start
    # Malformed tools add no words, and nothing raises from deep inside.
    assert tool_texts(["x", {"function": {"name": 3}}, {"name": "a", "description": None}]) == {b"a": "a"}


def test_the_first_named_key_in_the_schema_s_order_is_written_first():
    """ "Find the distance from Kreka destination = Port Fondath, unit = km": the model wrote the
    unit after the origin, and keys follow the schema's order, so the destination could no
    longer come. Of the named keys an object misses, the first in the schema's order comes next."""
    pieces = [b"Kreka", b'"', b", ", b'"unit', b'"destination', b'"dest']
    schema = {
        "type": "object",
        "properties": {"origin": STRING, "destination": STRING, "unit": UNIT},
        "required": ["origin", "unit"],
    }
    paths = schema_paths(schema)
    text = ["Find the distance from Kreka destination = Port Fondath, unit = km."]
    g = SpanGrounding(
        SpanIndex(pieces, skip=()), text, *paths[:2], enum_paths=paths.enums, objects=object_keys(schema)
    )
    g.feed(b'{"origin": "Kreka", ')
    logits = torch.zeros(len(pieces))
    g.restrict_(logits)
    assert {b'"destination', b'"dest'} <= _finite(logits, pieces) and b'"unit' not in _finite(logits, pieces)


def test_a_number_that_may_be_a_fraction_is_written_whole():
    """ "compute_bmi(66.7)" gave a weight of 66: a `number` ends where the text's number does; an
    `integer` may still take the whole part of "71.0"."""
    pieces = [b"66", b".", b"7", b"}"]
    text = ["Call compute_bmi(66.7)"]
    for kind, closes in (("number", False), ("integer", True)):
        paths = schema_paths({"type": "object", "properties": {"weight": {"type": kind}}})
        g = SpanGrounding(SpanIndex(pieces, skip=()), text, *paths[:2], integer_paths=paths.integers)
        g.feed(b'{"weight": 66')
        assert (b"}" in allowed(g, pieces)) is closes
        assert b"." in allowed(g, pieces)


def test_a_name_does_not_run_on_into_a_function_word_that_reaches_no_other_name():
    """ "the time zone of Ilpekrar for me", "a hotel in Kupintom with nights 12": the embedded model
    wrote "Ilpekrar for" and "Kupintom with". After a capitalised word, a function word whose run
    reaches no capitalised word ends the name; "Bank of America" runs on."""
    pieces = [b"Ilpekrar", b" for", b" me", b"Bank", b" of", b" America", b"python", b'"']
    g = _source_grounding("What is the time zone of Ilpekrar for me?", {"location": STRING}, pieces)
    g.feed(b'{"location": "Ilpekrar')
    assert allowed(g, pieces) == {b'"'}
    g = _source_grounding("The stock of Bank of America", {"company": STRING}, pieces)
    g.feed(b'{"company": "Bank')
    assert allowed(g, pieces) == {b'"', b" of"}
    g = _source_grounding("Search for python for beginners", {"query": STRING}, pieces)
    g.feed(b'{"query": "python')
    assert b" for" in allowed(g, pieces)  # not after a lowercase word
    pieces = [b"Meet", b" Bob", b" for", b" lunch", b'"']  # a quoted value is copied whole
    g = _source_grounding("Add a meeting 'Meet Bob for lunch' today", {"title": STRING}, pieces)
    g.feed(b'{"title": "Meet Bob')
    assert allowed(g, pieces) == {b" for"}


def test_no_value_runs_past_the_end_of_a_sentence_nor_takes_its_full_stop():
    """ "the share price for UJF. Please use a tool." gave "UJF. Please use a tool.", and
    "destination = Saint Stakaiva." a destination with the full stop. An initial or a short
    capitalised abbreviation ends no sentence ("St. Louis", "J. K. Rowling")."""
    pieces = [b"UJF", b".", b" Please", b"Saint", b" Stakaiva", b"St", b" Louis", b'"']
    g = _source_grounding("The share price for UJF. Please use a tool.", {"ticker": STRING}, pieces)
    g.feed(b'{"ticker": "UJF')
    assert allowed(g, pieces) == {b'"'}
    g = _source_grounding("From Kitu destination = Saint Stakaiva.", {"destination": STRING}, pieces)
    g.feed(b'{"destination": "Saint Stakaiva')
    assert allowed(g, pieces) == {b'"'}
    g = _source_grounding("Flights to St. Louis please", {"city": STRING}, pieces)
    g.feed(b'{"city": "St.')
    assert b" Louis" in allowed(g, pieces)
