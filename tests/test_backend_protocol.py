"""Capabilities are declared, not probed: every shipped backend declares the members of
`ModelBackend` (max_context, step_owner, supports_contexts, new_context, close), and the Agent acts
on what a backend declares, never on which attributes it happens to have."""

from __future__ import annotations

import asyncio
from collections.abc import Generator

import pytest
from tiny_models import build_tiny_model

from freetoken_agents import Agent, FreeTokenModel, GenerateRequest, OpenAICompatibleModel, tool
from freetoken_agents.backend import BackendBase, ModelBackend
from freetoken_agents.engine import Engine
from freetoken_agents.integrations.langchain.backend import LangChainBackend
from freetoken_agents.sync_bridge import step_worker
from freetoken_agents.testing import ScriptedModel, ToolCall
from freetoken_agents.tools import default_result_chars


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine.from_pretrained(build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("protocol")))


@tool
def echo(text: str) -> str:
    "Echo the text."
    return f"echo: {text}"


def test_every_shipped_backend_declares_the_protocol(engine: Engine) -> None:
    scripted = ScriptedModel([])
    remote = OpenAICompatibleModel("http://127.0.0.1:9/v1", "m", client=object())
    for one_context in (scripted, remote):
        assert isinstance(one_context, ModelBackend) and isinstance(one_context, BackendBase)
        assert one_context.supports_contexts is False
        assert one_context.max_context is None  # unknown
        assert one_context.step_owner is one_context
        with pytest.raises(NotImplementedError):
            one_context.new_context()
        one_context.close()  # nothing to release: a no-op, the backend stays usable
        assert one_context.position == 0

    for cls in (FreeTokenModel, LangChainBackend):
        model = cls(engine)
        assert isinstance(model, ModelBackend)
        assert model.supports_contexts is True
        assert model.max_context == engine.max_context
        with model.new_context() as context:
            assert isinstance(context, ModelBackend)
            assert model.step_owner is engine and context.step_owner is engine  # one worker per engine
        model.close()


def test_generate_returns_a_generator_the_agent_can_close() -> None:
    events = ScriptedModel(["hi"]).generate(GenerateRequest())
    assert isinstance(events, Generator)  # `close()` is part of what generate returns
    assert next(events).kind == "text"
    events.close()


class _Tracked(ScriptedModel):
    """A ScriptedModel with a `new_context` method of its own, whatever it declares: the Agent must
    follow `supports_contexts`, not the method's presence. Contexts share the script."""

    def __init__(self, turns: list, *, contexts: bool, shared: dict | None = None) -> None:
        super().__init__(turns)
        self.supports_contexts = contexts
        self.shared = shared if shared is not None else {"opened": [], "closed": 0, "script": list(turns)}
        self.turns = self.shared["script"]

    def new_context(self) -> _Tracked:
        context = _Tracked([], contexts=True, shared=self.shared)
        context.turns = self.shared["script"][len(self.shared["opened"]) * 2 :][:2]
        self.shared["opened"].append(context)
        return context

    def close(self) -> None:
        self.shared["closed"] += 1


def _answer(request: GenerateRequest, context: str) -> str:
    return context.rsplit("<|tool|>")[-1][:8]  # the tool's result, "echo: tN"


def _script(n: int) -> list:
    """Per run: call echo with "tN", then answer with what the tool returned."""
    return [turn for i in range(n) for turn in (ToolCall("echo", {"text": f"t{i}"}), _answer)]


def test_a_backend_declaring_no_contexts_runs_its_runs_in_turn_on_its_own_context() -> None:
    model = _Tracked(_script(3), contexts=False)  # has new_context, declares it unsupported
    agent = Agent(model, [echo])
    outputs = [agent.run(f"task {i}").output for i in range(3)]
    assert outputs == ["echo: t0", "echo: t1", "echo: t2"]
    assert model.shared["opened"] == [] and model.shared["closed"] == 0  # never asked for one
    assert model.remaining == 0 and len(model.contexts) == 6  # every turn ran on the model itself
    assert "task 2" in model.text  # the last run's context stays on the model


def test_a_backend_declaring_contexts_gets_one_per_run_closed_at_its_end() -> None:
    model = _Tracked(_script(2), contexts=True)
    agent = Agent(model, [echo])

    async def both() -> list[str]:
        return [r.output for r in await asyncio.gather(agent.arun("task 0"), agent.arun("task 1"))]

    assert sorted(asyncio.run(both())) == ["echo: t0", "echo: t1"]
    opened = model.shared["opened"]
    assert len(opened) == 2 and model.shared["closed"] == 2
    assert model.contexts == [] and model.text == ""  # the model's own context was never used
    assert all(len(c.contexts) == 2 for c in opened)
    # isolate_runs=False: the runs take turns on the model's own context instead
    shared = _Tracked(_script(1), contexts=True)
    assert Agent(shared, [echo], isolate_runs=False).run("task 0").output == "echo: t0"
    assert shared.shared["opened"] == [] and len(shared.contexts) == 2


class _Engine:
    """Stands for what several backends share (an engine)."""


class _Owned(ScriptedModel):
    """A backend whose steps belong to a shared owner (as FreeTokenModels share their engine) and
    whose context size is known."""

    def __init__(self, owner: object, max_context: int | None) -> None:
        super().__init__(["done"])
        self._owner, self._max = owner, max_context

    @property
    def step_owner(self) -> object:
        return self._owner

    @property
    def max_context(self) -> int | None:
        return self._max


def test_the_agent_uses_the_declared_step_owner_and_context_size() -> None:
    owner = _Engine()
    a, b = Agent(_Owned(owner, 1024)), Agent(_Owned(owner, None))
    assert a._worker is b._worker is step_worker(owner)  # one worker thread for the owner
    assert Agent(ScriptedModel([]))._worker is not a._worker
    assert a.max_result_chars == default_result_chars(1024)
    assert b.max_result_chars == default_result_chars(None)


def test_freetoken_models_over_one_engine_share_one_step_worker(engine: Engine) -> None:
    first, second = FreeTokenModel(engine), FreeTokenModel(engine)
    try:
        assert Agent(first)._worker is Agent(second)._worker is step_worker(engine)
    finally:
        first.close()
        second.close()


def test_a_freetoken_model_run_gets_a_context_of_its_own(engine: Engine) -> None:
    """FreeTokenModel declares contexts: a run opens one, so the model's own context is untouched."""
    model = FreeTokenModel(engine)
    try:
        Agent(model, max_new_tokens=2, max_steps=1).run("hi")
        assert model.position == 0  # the run used a context of its own
    finally:
        model.close()
