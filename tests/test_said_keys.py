"""Optional keys the conversation never mentions are not written under grounded arguments
(freetoken_agents/said_keys.py, `SpanGrounding`'s key masking), on a toy vocabulary."""

from __future__ import annotations

import torch

from freetoken_agents.grounding import SpanGrounding, SpanIndex, object_keys, schema_paths
from freetoken_agents.parsers.base import name_args_schema
from freetoken_agents.said_keys import objects_of, unsaid_keys

STRING, BOOLEAN, INTEGER = {"type": "string"}, {"type": "boolean"}, {"type": "integer"}
GENRE = {"type": "string", "enum": ["jazz", "rock"]}
PLAYLIST = {
    "type": "object",
    "properties": {"playlist_name": STRING, "public": BOOLEAN, "genre": GENRE},
    "required": ["playlist_name"],
}
ROOM = {
    "type": "object",
    "properties": {"building": STRING, "floor": INTEGER},
    "required": ["building", "floor"],
}
MEETING = {
    "type": "object",
    "properties": {"topic": STRING, "duration_minutes": INTEGER, "room": ROOM},
    "required": ["topic"],
}
PIECES = [b"Mix", b'"', b'",', b'", "', b'"}', b"}", b'"public', b'"genre', b", ", b",", b"13", b"3"]


def _grounding(schema: dict, text: str, pieces: list[bytes] = PIECES) -> SpanGrounding:
    paths = schema_paths(schema)
    return SpanGrounding(
        SpanIndex(pieces, skip=()),
        [text],
        *paths[:2],
        enum_paths=paths.enums,
        boolean_paths=paths.booleans,
        objects=object_keys(schema),
    )


def _finite_after(g: SpanGrounding, pieces: list[bytes] = PIECES) -> set[bytes]:
    logits = torch.zeros(len(pieces))
    g.restrict_(logits)
    return {pieces[i] for i in torch.nonzero(torch.isfinite(logits)).flatten().tolist()}


def test_an_optional_key_the_text_does_not_mention_is_not_written():
    """Held-out requests on the embedded model: "make a new playlist called 'γτμμξγαθ'" gave
    `public: false`, "put a meeting called 'X' in the calendar. Please use a tool." a date of
    "tool". With no optional key mentioned the object closes after its required value: no comma,
    no key."""
    g = _grounding(PLAYLIST, "Make a playlist called 'Mix'. Thanks")
    g.feed(b'{"playlist_name": "Mix')
    finite = _finite_after(g)
    assert b'"}' in finite and not {b'",', b'", "'} & finite
    g.feed(b'"')
    assert _finite_after(g) >= {b"}"} and not {b", ", b","} & _finite_after(g)


def test_an_optional_key_is_written_where_the_text_mentions_it_or_a_value_of_it():
    """ "public" by name; the enum genre by a value the text writes ("a jazz playlist"); each
    lets its own key be written, not the other's."""
    g = _grounding(PLAYLIST, "Make a public playlist called 'Mix'")
    g.feed(b'{"playlist_name": "Mix", ')
    finite = _finite_after(g)
    assert b'"public' in finite and b'"genre' not in finite
    g = _grounding(PLAYLIST, "Make a jazz playlist called 'Mix'")
    g.feed(b'{"playlist_name": "Mix", ')
    finite = _finite_after(g)
    assert b'"genre' in finite and b'"public' not in finite


def test_a_number_is_not_followed_by_a_comma_with_no_key_left_to_write():
    """ "a meeting about 'engine notebook galaxy' duration minutes: 13" gave a room of building
    "engine notebook galaxy" and floor 13: after the last mentioned key's number a comma piece
    (which holds no quote) led to a key only the unmentioned room could be."""
    g = _grounding(MEETING, "Schedule a meeting about 'Mix' duration minutes: 13")
    g.feed(b'{"topic": "Mix", "duration_minutes": 13')
    finite = _finite_after(g)
    assert b"}" in finite and not {b",", b", "} & finite


def test_which_names_mention_an_optional_key():
    """Its name as it is or in words, a word of its name that is no function word (a plural's
    "s" aside), or a key within it; required keys are never held back."""
    objects = {None: objects_of(MEETING)}
    paths = {(): frozenset({b"duration_minutes", b"room"})}
    assert unsaid_keys(objects, ["Book 'Mix'"], set()) == {None: paths}
    assert unsaid_keys(objects, ["Book 'Mix' for 30 minutes"], set()) == {None: {(): frozenset({b"room"})}}
    assert unsaid_keys(objects, ["Book 'Mix' in the north building"], set()) == {
        None: {(): frozenset({b"duration_minutes"})}
    }
    assert unsaid_keys(objects, ["Book 'Mix' in rooms 1-3, any duration"], set()) == {}
    # A value grounding found below the key's path mentions it too.
    assert unsaid_keys(objects, ["Book 'Mix'"], {(b"room", b"floor")}) == {
        None: {(): frozenset({b"duration_minutes"})}
    }
    # "of" and "a" are no words a key is mentioned by.
    short = {None: objects_of({"type": "object", "properties": {"name": STRING, "a_of": STRING}})}
    assert unsaid_keys(short, ["a list of things"], set()) == {None: {(): frozenset({b"a_of"})}}


def test_a_call_holds_back_only_the_chosen_tool_s_unmentioned_keys():
    """With several tools, each tool's keys are its own: the playlist tool's `public` is held
    back, another tool's mentioned `public` is not."""
    tools = [
        {"type": "function", "function": {"name": "new_playlist", "parameters": PLAYLIST}},
        {
            "type": "function",
            "function": {
                "name": "share",
                "parameters": {"type": "object", "properties": {"link": STRING, "public": BOOLEAN}},
            },
        },
    ]
    schema = name_args_schema(tools)
    keys = object_keys(schema)
    assert set(keys) == {b"new_playlist", b"share"}
    g = _grounding(schema, "Make a playlist called 'Mix'")
    assert g.unsaid == {
        b"new_playlist": {(b"arguments",): frozenset({b"public", b"genre"})},
        b"share": {(b"arguments",): frozenset({b"public"})},
    }
    g.feed(b'{"name": "new_playlist", "arguments": {"playlist_name": "Mix')
    assert b'", "' not in _finite_after(g)


def test_an_object_with_branches_holds_nothing_back():
    schema = {"type": "object", "properties": {"a": STRING}, "anyOf": [{"required": ["a"]}]}
    assert objects_of(schema) == {}


def test_an_object_s_first_key_is_never_held_back():
    """A schema that leaves its main parameter optional (`get_weather(city=None)`, every argument
    with a default) still takes "weather in Paris" as its city: the first key is the main one."""
    weather = {"type": "object", "properties": {"city": STRING, "unit": GENRE}}
    assert objects_of(weather)[()].optional == {b"unit": frozenset({"unit"})}
    g = _grounding(weather, "What is the weather in Paris?", [b'"city', b'"unit', b"}", b'"'])
    g.feed(b"{")
    assert {b'"city', b"}"} <= _finite_after(g, [b'"city', b'"unit', b"}", b'"'])
