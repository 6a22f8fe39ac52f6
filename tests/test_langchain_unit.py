"""langchain-tests `ChatModelUnitTests` for ChatFreeToken, constructed over a real tiny checkpoint."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
from langchain_tests.unit_tests import ChatModelUnitTests
from tiny_models import build_tiny_model

from freetoken_agents.integrations.langchain import ChatFreeToken


@functools.cache
def tiny_chat_checkpoint() -> Path:
    """A tiny random qwen3_moe with the Hermes/ChatML tokenizer, built once per process."""
    out = Path(tempfile.mkdtemp(prefix="freetoken-lc-unit-"))
    return build_tiny_model("qwen3_moe", out, max_position_embeddings=4096)


@pytest.fixture(autouse=True)
def _benchmark_once(request: pytest.FixtureRequest) -> None:
    """The `--benchmark-disable` behaviour for this module: `test_init_time` runs its loop once
    instead of being calibrated over thousands of rounds."""
    session = getattr(request.config, "_benchmarksession", None)
    if session is not None:
        session.disabled = True


class TestChatFreeTokenUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatFreeToken]:
        return ChatFreeToken

    @property
    def chat_model_params(self) -> dict:
        return {"model": str(tiny_chat_checkpoint())}

    @pytest.mark.xfail(
        strict=True,
        reason="the standard test loads with allowed_objects='all', LangChain's allow-list of its own "
        "partner classes, which no other package's class can be on, and compares with a stored "
        "snapshot, which holds this run's temporary checkpoint path; ChatFreeToken's dumpd/load round "
        "trip is tested in test_langchain_serialization.py",
    )
    def test_serdes(self, model, snapshot) -> None:  # type: ignore[override]
        super().test_serdes(model, snapshot)


def test_model_name_alias_and_ignored_kwargs() -> None:
    llm = ChatFreeToken(model_name="/nowhere", timeout=5, max_retries=1, api_key="k", organization="x")
    assert llm.model == "/nowhere"
    assert llm._get_ls_params(model="other")["ls_model_name"] == "other"
    assert llm.profile and llm.profile["tool_calling"]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, "auto"),
        ("auto", "auto"),
        ("none", "none"),
        ("any", "required"),
        ("required", "required"),
        (True, "required"),
        ("add", "add"),
        ({"type": "function", "function": {"name": "add"}}, "add"),
        ({"type": "tool", "name": "add"}, "add"),
        ({"type": "any"}, "required"),
    ],
)
def test_tool_choice_forms(choice: object, expected: str) -> None:
    from freetoken_agents.integrations.langchain.tool_choice import normalize_tool_choice

    assert normalize_tool_choice(choice, ["add"]) == expected


def test_unknown_tool_choice_is_rejected() -> None:
    from freetoken_agents.integrations.langchain.tool_choice import normalize_tool_choice

    with pytest.raises(ValueError, match="not one of the bound tools"):
        normalize_tool_choice("sub", ["add"])


def test_messages_render_as_template_dicts() -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    from freetoken_agents.integrations.langchain.messages import to_chat_dicts

    dicts = to_chat_dicts(
        [
            SystemMessage("a"),
            SystemMessage("b"),
            HumanMessage([{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}], name="ann"),
            AIMessage(
                [{"type": "text", "text": "t"}, {"type": "tool_use", "id": "1", "name": "f", "input": {}}],
                tool_calls=[{"name": "f", "args": {"x": "你好"}, "id": "1", "type": "tool_call"}],
            ),
            ToolMessage("bad b", tool_call_id="1", status="error"),
        ]
    )
    assert dicts[0] == {"role": "system", "content": "a\n\nb"}
    assert dicts[1] == {"role": "user", "content": "hi there", "name": "ann"}
    assert dicts[2]["content"] == "t"
    assert dicts[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": "你好"}}
    assert dicts[3]["role"] == "tool" and dicts[3]["content"] == "Error: bad b"


@pytest.mark.parametrize(("mode", "restored"), [("signature", True), ("full", False)])
def test_prefix_cache_restore_honours_validate(mode: str, restored: bool) -> None:
    """A cached prompt whose KV was corrupted in a middle block: "signature" (edges only) restores
    it, "full" rejects it and the prompt is prefilled again from the live session's prefix."""
    import torch

    from freetoken_agents.engine import Engine
    from freetoken_agents.integrations.langchain.backend import LangChainBackend
    from freetoken_agents.integrations.langchain.prefix_cache import PrefixCache, prepare_context

    engine = Engine.from_pretrained(tiny_chat_checkpoint())
    backend, cache = LangChainBackend(engine, validate=mode), PrefixCache()
    prompt = backend.render([{"role": "user", "content": "A long shared prefix. " * 8}], None)
    other = backend.render([{"role": "user", "content": "Something else entirely."}], None)
    assert prepare_context(backend, cache, prompt, reuse=True) == 0
    anchor = cache.lookup(prompt).anchor
    prepare_context(backend, cache, other, reuse=True)  # the live session moves away
    with torch.inference_mode():
        for tensor in engine.kv_pool.storage[0].values():
            tensor[anchor.blocks[len(anchor.blocks) // 2]] += 1.0
    reused = prepare_context(backend, cache, prompt, reuse=True)
    live = 0
    while prompt[live] == other[live]:
        live += 1
    assert reused == (len(prompt) - 1 if restored else live)  # restored: only the last token reruns
