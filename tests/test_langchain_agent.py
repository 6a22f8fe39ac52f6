"""A real `langchain.agents.create_agent` loop over ChatFreeToken (tiny random model): two tools,
one of which raises and is handled by LangChain's ToolErrorMiddleware, and the prefix-reuse
contract: each step after the first prefills only the messages that step added."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from langchain.agents import create_agent
from langchain.agents.middleware import ToolErrorMiddleware, wrap_model_call
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from tiny_models import build_tiny_model

from freetoken_agents.integrations.langchain import ChatFreeToken

BLOCK = 16  # the engine's KV block size: the most a step may re-prefill of what it reused before


@functools.cache
def tiny_chat_checkpoint() -> Path:
    out = Path(tempfile.mkdtemp(prefix="freetoken-lc-agent-"))
    return build_tiny_model("qwen3_moe", out, max_position_embeddings=4096)


@tool
def lookup(city: str) -> str:
    """Look up facts about a city."""
    return f"{city[:12]} is a city."


@tool
def flaky(query: str) -> str:
    """A tool whose backend is down."""
    raise RuntimeError("backend unavailable")


# A tiny random model will not choose tools by itself: this middleware scripts the choices
# (a forced call is still generated, under the tool's grammar, by the model).
SCRIPT = ["lookup", "flaky", "lookup", "lookup", "lookup", "none"]


def scripted_choices() -> object:
    step = {"n": 0}

    @wrap_model_call
    def choose(request, handler):  # type: ignore[no-untyped-def]
        choice = SCRIPT[min(step["n"], len(SCRIPT) - 1)]
        step["n"] += 1
        return handler(request.override(tool_choice=choice))

    return choose


def on_tool_error(error: Exception, request: object) -> str:
    return f"{type(error).__name__}: {error}"


@functools.cache
def run_agent(prefix_cache: bool = True) -> list:
    """One six-step agent run (cached: two tests read the same run)."""
    llm = ChatFreeToken(
        model=str(tiny_chat_checkpoint()), max_tokens=4, max_call_tokens=12, prefix_cache=prefix_cache
    )
    agent = create_agent(
        llm,
        [lookup, flaky],
        system_prompt="You answer questions about cities.",
        middleware=[scripted_choices(), ToolErrorMiddleware(on_error=on_tool_error)],
    )
    state = agent.invoke({"messages": [("user", "Tell me about Paris.")]}, {"recursion_limit": 30})
    return state["messages"]


def test_agent_loop_with_a_failing_tool_completes() -> None:
    messages = run_agent()
    ai = [m for m in messages if isinstance(m, AIMessage)]
    tools = [m for m in messages if isinstance(m, ToolMessage)]
    assert len(ai) == len(SCRIPT)
    assert [c["name"] for m in ai[:-1] for c in m.tool_calls] == SCRIPT[:-1]
    assert not ai[-1].tool_calls  # tool_choice "none": the loop ends with a plain answer
    failed = [m for m in tools if m.status == "error"]
    assert len(failed) == 1 and "backend unavailable" in failed[0].text
    assert all(m.status == "success" for m in tools if m is not failed[0])


def test_each_step_prefills_only_the_new_messages() -> None:
    ai = [m for m in run_agent() if isinstance(m, AIMessage)]
    usage = [m.usage_metadata for m in ai]
    assert usage[0]["input_token_details"]["cache_read"] < usage[0]["input_tokens"]
    for prev, cur in zip(usage, usage[1:], strict=False):
        cache_read = cur["input_token_details"]["cache_read"]
        assert cache_read >= prev["input_tokens"] - BLOCK, (prev, cur)
        assert cur["input_tokens"] > prev["input_tokens"]


def test_reuse_disabled_prefills_everything() -> None:
    ai = [m for m in run_agent(prefix_cache=False) if isinstance(m, AIMessage)]
    assert all(m.usage_metadata["input_token_details"]["cache_read"] == 0 for m in ai)
