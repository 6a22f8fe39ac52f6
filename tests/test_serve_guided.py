"""The peers' output constraints through `freetoken serve`, sent by the real `openai` client through
`extra_body` (issue 63, item 6): vLLM's `guided_choice`, `guided_regex`, `guided_grammar` and
`structured_outputs`, llama-server's `grammar` (GBNF) and `json_schema`. The reply obeys the
constraint whatever the model would have written (several seeds at temperature 1); a malformed
one is a 400 naming the field as sent."""

from __future__ import annotations

import json
import re

import openai
import pytest
from serve_harness import MODEL, TOOLS

pytestmark = pytest.mark.usefixtures("one_thread")

HI = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = (0, 1, 2)


def create(client, *, max_tokens: int = 24, seed: int = 0, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=HI, temperature=1, seed=seed, max_tokens=max_tokens, extra_body=extra
    )


def refused(client, param: str, **extra) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        create(client, **extra)
    body = info.value.body
    assert body["param"] == param, body
    return body["message"]


# strings that must reach the grammar escaped: a quote, a newline, a backslash, non-ASCII
CHOICES = ["sunny", 'a "quoted"\nline', "back\\slash", "é😀", "rain"]


@pytest.mark.parametrize("seed", SEEDS)
def test_guided_choice_reply_is_exactly_one_of_the_strings(client, seed):
    r = client.chat.completions.create(
        model=MODEL, messages=HI, temperature=1, seed=seed, n=2, extra_body={"guided_choice": CHOICES}
    )
    assert [c.message.content for c in r.choices if c.message.content not in CHOICES] == []
    assert {c.finish_reason for c in r.choices} == {"stop"}


def test_guided_choice_streams_one_of_the_strings(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=HI, temperature=1, stream=True, extra_body={"guided_choice": CHOICES}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) in CHOICES
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("seed", SEEDS)
def test_guided_regex_reply_matches_the_whole_regex(client, seed):
    r = create(client, seed=seed, guided_regex=r"[0-9]{3}-[0-9]{4}")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].message.content)
    assert r.choices[0].finish_reason == "stop"


# GBNF as llama.cpp writes it: rules, alternatives, a character class, comments
GBNF = """# the verdict, then why
root ::= "Answer: " verdict ", " reason "."
verdict ::= "yes" | "no"
reason ::= [a-z]{1,12}  # one short word
"""
GBNF_TEXT = re.compile(r"Answer: (yes|no), [a-z]{1,12}\.")


@pytest.mark.parametrize("field", ["grammar", "guided_grammar"])  # llama-server's, vLLM's
def test_grammar_reply_follows_the_grammar(client, field):
    for seed in SEEDS:
        r = create(client, seed=seed, **{field: GBNF})
        assert GBNF_TEXT.fullmatch(r.choices[0].message.content), r.choices[0].message.content


@pytest.mark.parametrize(
    "key, value, check",
    [
        ("choice", ["left", "right"], lambda text: text in ("left", "right")),
        ("regex", r"[A-Z][a-z]{2,5}", lambda text: re.fullmatch(r"[A-Z][a-z]{2,5}", text)),
        ("grammar", 'root ::= "x" [0-9]', lambda text: re.fullmatch(r"x[0-9]", text)),
        ("json", {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
         lambda text: isinstance(json.loads(text)["n"], int)),
        ("json_object", True, lambda text: isinstance(json.loads(text), dict)),
    ],
)  # fmt: skip
def test_structured_outputs_keys_are_vllm_newer_spelling(client, key, value, check):
    r = create(client, max_tokens=32, structured_outputs={key: value})
    assert check(r.choices[0].message.content), r.choices[0].message.content


def test_llama_server_json_schema_field_is_a_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    }
    r = create(client, max_tokens=32, json_schema=schema)
    assert set(json.loads(r.choices[0].message.content)) == {"city"}


def test_llama_server_empty_grammar_is_unset(client):
    r = create(client, max_tokens=4, temperature=0, grammar="")
    assert r.choices[0].message.content is not None  # a plain reply, as llama-server's default ""


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop", [" ", ", "])  # ", " may come in two tokens: held back between
def test_stop_cuts_a_grammar_reply(client, stop, stream):
    # vLLM applies stop strings to guided output too: the first separator ends this one
    regex = f"[a-z]{{1,6}}({stop}[a-z]{{1,6}}){{3}}"
    for seed in SEEDS:
        r = client.chat.completions.create(
            model=MODEL, messages=HI, temperature=1, seed=seed, max_tokens=40, stream=stream, stop=[stop],
            extra_body={"guided_regex": regex},
        )  # fmt: skip
        if stream:
            chunks = [c for c in r if c.choices]
            text, finish = (
                "".join(c.choices[0].delta.content or "" for c in chunks),
                chunks[-1].choices[0].finish_reason,
            )
        else:
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert re.fullmatch("[a-z]{1,6}", text) and finish == "stop", (text, finish)


def test_grammar_reply_cut_by_max_tokens_says_length(client):
    # no closing guarantee for a regex or grammar (as with the peers): the budget ends it
    r = create(client, max_tokens=4, guided_regex="[a-z]{200}")
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert re.fullmatch("[a-z]+", r.choices[0].message.content)


def test_tool_choice_none_keeps_the_tools_in_the_prompt_and_the_constraint(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=HI,
        temperature=1,
        tools=TOOLS,
        tool_choice="none",
        extra_body={"guided_choice": ["a", "b"]},
    )
    assert r.choices[0].message.content in ("a", "b") and not r.choices[0].message.tool_calls


@pytest.mark.parametrize(
    "tool_choice", ["auto", "required", {"type": "function", "function": {"name": "add"}}]
)
def test_a_constraint_with_tools_that_may_be_called_is_refused(client, tool_choice):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=HI,
            tools=TOOLS,
            tool_choice=tool_choice,
            extra_body={"guided_regex": "[a-z]+"},
        )
    assert info.value.body["param"] == "guided_regex"
    assert "tool_choice 'none'" in info.value.body["message"]


@pytest.mark.parametrize(
    "param, extra, words",
    [
        ("guided_regex", {"guided_regex": "(ab"}, "regex cannot be compiled"),
        ("guided_regex", {"guided_regex": "(?=a)a"}, "Lookahead"),
        ("guided_regex", {"guided_regex": 5}, "must be a string"),
        ("grammar", {"grammar": 'root ::= "yes" |'}, "grammar cannot be compiled"),
        ("guided_grammar", {"guided_grammar": 'start ::= "x"'}, "root"),
        ("guided_choice", {"guided_choice": []}, "non-empty list of strings"),
        ("guided_choice", {"guided_choice": ["a", 1]}, "non-empty list of strings"),
        ("guided_choice", {"guided_choice": "yes"}, "non-empty list of strings"),
        ("json_schema", {"json_schema": "{not json"}, "not valid JSON"),
        ("structured_outputs", {"structured_outputs": "x"}, "JSON object"),
        ("structured_outputs.regex", {"structured_outputs": {"regex": "[a-"}}, "cannot be compiled"),
        ("guided_choice", {"guided_regex": "a", "guided_choice": ["a"]}, "not both"),
        (
            "structured_outputs.choice",
            {"grammar": 'root ::= "a"', "structured_outputs": {"choice": ["a"]}},
            "not both",
        ),
        (
            "guided_choice",
            {"guided_choice": ["a"], "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ("guided_regex", {"guided_regex": "a" * 70_000}, "at most"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_field(client, param, extra, words):
    assert words in refused(client, param, **extra)
