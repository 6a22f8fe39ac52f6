"""Many concurrent `ainvoke` calls on one ChatFreeToken all finish, each with the answer it gets
alone: a waiting call blocks its own thread, never a worker of the loop's default executor."""

from __future__ import annotations

import asyncio

import pytest

from freetoken_agents import default_model
from freetoken_agents.integrations.langchain import ChatFreeToken, clear_engines

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = [f"What is {a} times {b}?" for a, b in zip(range(2, 18), range(31, 47), strict=True)]


async def test_sixteen_concurrent_ainvoke_calls_all_finish_with_their_own_answers():
    """The bug: run_turn holds the handle's lock across steps and each step ran on a default
    executor worker; with the executor's few workers all waiting for the lock, the holder never
    got one back (7 concurrent calls hung forever on 2 cores)."""
    clear_engines()
    llm = ChatFreeToken(model=str(default_model()), max_tokens=8)
    alone = [llm.invoke(q).content for q in QUESTIONS]
    # A safety net only: a deadlock fails the test instead of hanging the suite.
    answers = await asyncio.wait_for(asyncio.gather(*(llm.ainvoke(q) for q in QUESTIONS)), timeout=600)
    assert [a.content for a in answers] == alone
    streamed = []
    async for chunk in llm.astream(QUESTIONS[0]):  # streaming still yields chunk by chunk
        streamed.append(chunk.content)
    assert "".join(streamed) == alone[0] and len([c for c in streamed if c]) > 1
    clear_engines()
