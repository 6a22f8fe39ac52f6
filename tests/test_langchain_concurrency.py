"""Many concurrent `ainvoke` calls on one ChatFreeToken all finish, each with the answer it gets
alone; each call has a context of its own, and every front end's steps run on the engine's one
step worker."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi.testclient import TestClient

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


async def test_each_call_has_a_context_of_its_own_and_runs_on_the_engines_step_worker(monkeypatch):
    """One executor per engine: ChatFreeToken's steps (sync and async calls), an Agent's and the
    server's all run on the engine's step worker; each ChatFreeToken call opens a context of its
    own (closed at its end) instead of taking turns on one shared session under a lock, so
    concurrent calls interleave and the shared backend's own context is never used."""
    from freetoken_agents import Agent
    from freetoken_agents.engine import Session
    from freetoken_agents.integrations.langchain.engines import EngineHandle, shared_engine
    from freetoken_agents.integrations.openai_server import ServerConfig, create_app
    from freetoken_agents.model import FreeTokenModel
    from freetoken_agents.sync_bridge import run_on

    clear_engines()
    llm = ChatFreeToken(model=str(default_model()), max_tokens=6)
    handle = shared_engine(str(default_model()), llm.engine_options(), family=llm.tool_format)
    steps: set[int] = set()
    held: list[object] = []  # the contexts calls hold right now
    overlapped = 0  # calls that got a context while another call held one
    real_forward, real_open, real_release = (
        Session._forward,
        EngineHandle.open_context,
        EngineHandle.release_context,
    )

    def forward(self, ids, *, last_only):  # every forward pass of the engine
        steps.add(threading.get_ident())
        return real_forward(self, ids, last_only=last_only)

    def open_context(self):
        nonlocal overlapped
        context = real_open(self)
        assert context is not self.backend and all(context is not other for other in held)
        overlapped += bool(held)
        held.append(context)
        return context

    def release_context(self, context, *, keep=True):
        held.remove(context)
        return real_release(self, context, keep=keep)

    monkeypatch.setattr(Session, "_forward", forward)
    monkeypatch.setattr(EngineHandle, "open_context", open_context)
    monkeypatch.setattr(EngineHandle, "release_context", release_context)
    alone = [llm.invoke(q).content for q in QUESTIONS[:4]]
    assert overlapped == 0
    answers = await asyncio.wait_for(asyncio.gather(*(llm.ainvoke(q) for q in QUESTIONS[:4])), timeout=600)
    assert [a.content for a in answers] == alone
    assert overlapped > 0 and not held  # concurrent calls held contexts of their own, all given back
    assert handle.backend.position == 0  # the shared backend's own context was never used
    Agent(FreeTokenModel(handle.engine)).run("Hello")
    with TestClient(create_app(handle.engine, ServerConfig(model_name="tiny"))) as client:
        reply = client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        )
        assert reply.status_code == 200
    worker = run_on(handle.worker, threading.get_ident)
    assert steps == {worker}  # ChatFreeToken (sync and async), the Agent and the server: one thread
    clear_engines()
