"""langchain-tests `ChatModelIntegrationTests` for ChatFreeToken on the real engine (tiny random
qwen3_moe, Hermes/ChatML template). Every protocol test runs as is; the four tool-calling tests
that assert what a model must *understand* (an argument value taken from the prompt, deciding on
its own to call a tool) run on the embedded trained model instead, unchanged: it learnt generic
tool use from recipes/tiny/generic.py, whose tools and requests are random (never these)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from tiny_models import build_tiny_model

from freetoken_agents import default_model
from freetoken_agents.integrations.langchain import ChatFreeToken
from freetoken_agents.integrations.langchain.messages import to_chat_dicts


@functools.cache
def tiny_chat_checkpoint() -> Path:
    out = Path(tempfile.mkdtemp(prefix="freetoken-lc-int-"))
    return build_tiny_model("qwen3_moe", out, max_position_embeddings=4096)


class TestChatFreeTokenIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatFreeToken]:
        return ChatFreeToken

    @property
    def chat_model_params(self) -> dict:
        return {"model": str(tiny_chat_checkpoint()), "max_tokens": 8, "max_call_tokens": 24}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        llm = self.chat_model_class(**self.chat_model_params)
        prompt = [HumanMessage("A long shared prefix. " * 20)]
        llm.invoke(prompt)
        if stream:
            full = None
            for chunk in llm.stream(prompt):
                full = chunk if full is None else full + chunk
            assert full is not None
            assert full.usage_metadata["input_token_details"]["cache_read"] > 0
            return full  # type: ignore[return-value]
        msg = llm.invoke(prompt)
        assert msg.usage_metadata["input_token_details"]["cache_read"] > 0
        return msg

    @pytest.fixture
    def model(self, request: pytest.FixtureRequest) -> BaseChatModel:
        """The standard fixture, on the embedded trained model for the tests that need a model to
        understand the request (the standard tests themselves stay unchanged)."""
        extra = getattr(request, "param", None) or {}
        llm = self.chat_model_class(**{**self.standard_chat_model_params, **self.chat_model_params, **extra})
        if request.node.originalname in ON_THE_EMBEDDED_MODEL:
            llm = embedded(llm)
        return llm


# test_tool_calling(_async): {'input': 3} from "magic_function(3)", which the embedded model gets
# with its default grounded arguments (freetoken_agents/grounding.py). test_agent_loop: with
# tool_choice auto it decides to call get_weather for "What is the weather in San Francisco, CA?".
# test_unicode_tool_call_integration: "a customer named '你好啊集团'" names the customer_name
# (freetoken_agents/named_values.py), and a quoted value is copied whole.
ON_THE_EMBEDDED_MODEL = {
    "test_tool_calling",
    "test_tool_calling_async",
    "test_unicode_tool_call_integration",
    "test_agent_loop",
}


def embedded(model: BaseChatModel) -> ChatFreeToken:
    """The fixture's model, on the embedded trained model (same settings otherwise)."""
    assert isinstance(model, ChatFreeToken)
    return model.model_copy(update={"model": str(default_model())})


def _customer(customer_name: str, description: str) -> str:
    """Create a customer."""
    return customer_name


def test_unicode_tool_call_round_trip() -> None:
    """The protocol half of the unicode test: a forced call keeps non-ASCII text intact, and a
    history holding a unicode call and result renders and continues."""
    llm = ChatFreeToken(model=str(tiny_chat_checkpoint()), max_tokens=4, max_call_tokens=16)
    bound = llm.bind_tools([_customer], tool_choice="_customer")
    msg = bound.invoke("Create a customer named '你好啊集团'")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "_customer"
    assert set(msg.tool_calls[0]["args"]) == {"customer_name", "description"}
    history = [
        HumanMessage("Create a customer named '你好啊集团'"),
        AIMessage(
            "",
            tool_calls=[
                {
                    "name": "_customer",
                    "args": {"customer_name": "你好啊集团", "description": "こんにちは"},
                    "id": "c1",
                    "type": "tool_call",
                }
            ],
        ),
        ToolMessage("你好啊集团", tool_call_id="c1"),
    ]
    ids = llm._handle().backend.render(to_chat_dicts(history), None)
    assert "你好啊集团" in llm._handle().backend.tokenizer.decode(ids)
    assert isinstance(bound.invoke(history), AIMessage)


def test_streamed_tool_call_chunks_have_an_index() -> None:
    llm = ChatFreeToken(model=str(tiny_chat_checkpoint()), max_tokens=4, max_call_tokens=16)
    chunks = list(llm.bind_tools([_customer], tool_choice="any").stream("hi"))
    calls = [c for ch in chunks for c in ch.tool_call_chunks]
    assert calls and calls[0]["index"] == 0 and calls[0]["id"]
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata
    assert sum(1 for ch in chunks if ch.usage_metadata) == 1


def test_context_overflow_is_langchains_error() -> None:
    from langchain_core.exceptions import ContextOverflowError

    llm = ChatFreeToken(model=str(tiny_chat_checkpoint()), max_tokens=4)
    with pytest.raises(ContextOverflowError):
        llm.invoke("word " * 5000)


def _pair(a: int, b: int, label: str) -> str:
    """Pair two numbers."""
    return label


def test_forced_calls_close_inside_small_budgets_or_say_the_limit_is_too_small() -> None:
    from freetoken_agents import TokenLimitTooSmall

    with pytest.raises(TokenLimitTooSmall, match="max_call_tokens=1 is too small") as info:
        ChatFreeToken(model=str(tiny_chat_checkpoint()), max_call_tokens=1).bind_tools(
            [_pair], tool_choice="_pair"
        ).invoke("pair 1 and 2")
    for budget in range(info.value.needed, info.value.needed + 4):
        llm = ChatFreeToken(
            model=str(tiny_chat_checkpoint()), max_call_tokens=budget, temperature=1.0, seed=budget
        )
        msg = llm.bind_tools([_pair], tool_choice="any").invoke("pair 1 and 2")
        assert msg.invalid_tool_calls == [] and set(msg.tool_calls[0]["args"]) == {"a", "b", "label"}


def test_sdk_and_langchain_share_one_constrained_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced calls (SDK and LangChain) and structured output all decode in ConstrainedDecode."""
    from pydantic import BaseModel

    from freetoken_agents import Agent, FreeTokenModel, tool
    from freetoken_agents.constrained import ConstrainedDecode

    runs: list[int] = []
    iterate = ConstrainedDecode.__iter__

    def counted(self):  # type: ignore[no-untyped-def]
        runs.append(self.budget)
        return iterate(self)

    monkeypatch.setattr(ConstrainedDecode, "__iter__", counted)

    class Point(BaseModel):
        x: int
        y: int

    llm = ChatFreeToken(model=str(tiny_chat_checkpoint()), max_tokens=4, max_call_tokens=20)
    assert llm.bind_tools([_pair], tool_choice="_pair").invoke("pair").tool_calls
    assert isinstance(llm.with_structured_output(Point).invoke("a point"), Point)
    assert isinstance(llm.with_structured_output(Point, method="json_schema").invoke("a point"), Point)
    model, pair = FreeTokenModel(llm._handle().engine), tool(_pair)
    settings = {"max_call_tokens": 20}
    result = Agent(model, [pair], tool_choice="_pair", max_new_tokens=2, model_settings=settings).run("pair")
    assert result.trace.tool_calls[0].tool == "_pair"
    assert runs == [20] * 4
