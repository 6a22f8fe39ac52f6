"""ChatFreeToken as data (issue 63): `langchain_core.load.dumpd` / `load` round trips (alone and
inside a chain) give a working ChatFreeToken with the same fields and no secret in the dump; and
the content it cannot read (images, audio, files) is refused with a named error, never dropped."""

from __future__ import annotations

import json

import pytest
from langchain_core.load import dumpd, dumps, load, loads
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.messages.content import create_image_block
from langchain_core.prompts import ChatPromptTemplate, HumanMessagePromptTemplate, PromptTemplate
from langchain_core.runnables import RunnableSequence

from freetoken_agents import default_model
from freetoken_agents.engine import MemoryBudget
from freetoken_agents.integrations.langchain import ChatFreeToken
from freetoken_agents.integrations.langchain.messages import UnsupportedContentError

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore::langchain_core._api.beta_decorator.LangChainBetaWarning"),
]

TRUSTED = {"valid_namespaces": ["freetoken_agents"]}  # what a user loading their own chain passes


def embedded(**fields: object) -> ChatFreeToken:
    return ChatFreeToken(model=str(default_model()), temperature=0.0, max_tokens=6, **fields)


def test_dumpd_is_a_constructor_at_the_public_import_path():
    data = dumpd(embedded())
    assert data["type"] == "constructor"  # was "not_implemented": chains that save it failed
    assert data["id"] == ["freetoken_agents", "integrations", "langchain", "ChatFreeToken"]
    assert data["kwargs"]["model"] == str(default_model()) and data["kwargs"]["max_tokens"] == 6


def test_a_round_trip_gives_a_working_model_with_the_same_fields():
    llm = embedded(stop=["\n\n"], seed=3, prefix_cache=False, memory=MemoryBudget(host_bytes=1 << 30))
    loaded = loads(dumps(llm), allowed_objects=[ChatFreeToken], **TRUSTED)
    assert type(loaded) is ChatFreeToken and loaded is not llm
    assert loaded.model_dump() == llm.model_dump()
    assert loaded.engine_options() == llm.engine_options()  # the engine loads the same way
    prompt = [HumanMessage("What is the weather in Paris?")]
    assert loaded.invoke(prompt).content == llm.invoke(prompt).content  # greedy: the same reply


def test_a_chain_with_the_model_round_trips():
    prompt = ChatPromptTemplate.from_messages([("system", "Answer briefly."), ("human", "{question}")])
    chain = prompt | embedded()
    allowed = [
        ChatFreeToken,
        RunnableSequence,
        ChatPromptTemplate,
        HumanMessagePromptTemplate,
        PromptTemplate,
    ]
    allowed.append(type(prompt.messages[0]))  # SystemMessagePromptTemplate
    loaded = load(json.loads(json.dumps(dumpd(chain))), allowed_objects=allowed, **TRUSTED)
    question = {"question": "What is 12 times 7?"}
    assert isinstance(loaded.last, ChatFreeToken)
    assert loaded.invoke(question).content == chain.invoke(question).content


def test_an_api_key_never_lands_in_the_dump():
    text = dumps(embedded(api_key="sk-very-secret"))
    assert "sk-very-secret" not in text
    assert json.loads(text)["kwargs"]["api_key"] == {"lc": 1, "type": "secret", "id": ["FREETOKEN_API_KEY"]}
    loaded = loads(text, allowed_objects=[ChatFreeToken], secrets_map={"FREETOKEN_API_KEY": "k2"}, **TRUSTED)
    assert loaded.api_key == "k2"


# ---- content the model cannot read ----------------------------------------------------------------
IMAGE_URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.mark.parametrize(
    ("block", "says"),
    [
        (IMAGE_URL, "images are not supported"),
        (create_image_block(url="https://example.com/cat.png"), "images are not supported"),
        (
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            "audio inputs are not supported",
        ),
        ({"type": "file", "base64": "JVBERi0=", "mime_type": "application/pdf"}, "files are not supported"),
    ],
    ids=["openai-image_url", "standard-image", "audio", "file"],
)
def test_a_media_block_is_refused_not_dropped(block, says):
    # "/nowhere": refused before any weights load (loading would fail with another error)
    llm = ChatFreeToken(model="/nowhere")
    messages = [SystemMessage("Be brief."), HumanMessage([{"type": "text", "text": "What is this?"}, block])]
    with pytest.raises(UnsupportedContentError, match=says) as caught:
        llm.invoke(messages)
    assert "message 1 (human)" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(UnsupportedContentError):
        next(iter(llm.stream(messages)))


async def test_a_media_block_is_refused_by_the_async_calls_too():
    llm = ChatFreeToken(model="/nowhere")
    with pytest.raises(UnsupportedContentError, match="images are not supported"):
        await llm.ainvoke([HumanMessage([IMAGE_URL])])
