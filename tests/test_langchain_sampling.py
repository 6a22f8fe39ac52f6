"""ChatFreeToken passes the sampling settings users set to the engine (issue 63): `top_k`, `min_p`,
`top_p` and the penalties were accepted by pydantic's `extra="ignore"` and silently dropped."""

from __future__ import annotations

from langchain_core.messages import HumanMessage

from freetoken_agents import default_model
from freetoken_agents.integrations.langchain import ChatFreeToken

ASK = [HumanMessage("What is the weather like in Osaka?")]


def reply(**fields) -> str:
    llm = ChatFreeToken(model=str(default_model()), max_tokens=12, prefix_cache=False, **fields)
    message = llm.invoke(ASK)
    return str(message.content) + repr(message.tool_calls)


def test_top_k_1_at_temperature_1_is_greedy_for_every_seed() -> None:
    greedy = reply(temperature=0.0)
    free = {reply(temperature=1.5, seed=s) for s in (1, 2, 3)}
    assert len(free) > 1  # these seeds sample different replies without top_k
    assert {reply(temperature=1.5, seed=s, top_k=1) for s in (1, 2, 3)} == {greedy}
    assert {reply(temperature=1.5, seed=s, min_p=1.0) for s in (1, 2, 3)} == {greedy}


def test_a_call_keyword_overrides_the_field_and_penalties_reach_greedy_decoding() -> None:
    llm = ChatFreeToken(model=str(default_model()), max_tokens=12, prefix_cache=False)
    plain = llm.invoke(ASK)
    penalised = llm.invoke(ASK, repetition_penalty=5.0, frequency_penalty=2.0)
    assert (plain.content, plain.tool_calls) != (penalised.content, penalised.tool_calls)
