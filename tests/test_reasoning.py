"""A thinking model's `<think>` block comes back apart from the answer (issue 35: Qwen3's block was
returned as part of the answer by the Agent, ChatFreeToken and the server; vLLM and llama-server
return it as `reasoning_content`). Real templates (Qwen3, DeepSeek-R1-Distill-Qwen, whose
generation prompt opens the block), on a tiny random Qwen3-MoE checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from real_templates import real_template
from serve_harness import MODEL, running_server

from freetoken_agents import FreeTokenModel, GenerateRequest
from freetoken_agents.engine import Engine
from freetoken_agents.integrations.langchain import ChatFreeToken

pytestmark = pytest.mark.usefixtures("one_thread")

QWEN3 = "Qwen-Qwen3-0.6B"
OPENS_THE_BLOCK = "StepFun3.5-Flash"  # its generation prompt ends with "<think>\n"
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "What is 2 + 3?"}]


def checkpoint_with(template: str, tiny_checkpoint, root: Path) -> Path:
    folder = root / template
    if not folder.exists():
        shutil.copytree(tiny_checkpoint("qwen3_moe"), folder)
        (folder / "chat_template.jinja").write_text(real_template(template))
    return folder


@pytest.fixture(scope="module")
def folders(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("thinking")
    return lambda template: checkpoint_with(template, tiny_checkpoint, root)


def turn(model: FreeTokenModel, request: GenerateRequest) -> tuple[str, str, list]:
    model.reset()
    model.sync(model.render(ASK, None))  # the tools' prompt would not fit the tiny context
    events = list(model.generate(request))
    text = "".join(e.text for e in events if e.kind == "text")
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    return text, reasoning, events


def test_a_think_block_is_reasoning_and_the_answer_follows_it(folders):
    model = FreeTokenModel(Engine.from_pretrained(folders(QWEN3)))
    prefix = "<think>\nTwo plus three is five.\n</think>\n\n"  # what Qwen3 writes first
    text, reasoning, _ = turn(model, GenerateRequest(prefix=prefix, max_new_tokens=6, temperature=0))
    assert reasoning == "Two plus three is five."
    assert "<think>" not in text and "</think>" not in text and "five" not in text
    assert text and not text[0].isspace()  # the blank lines after the block are not the answer


def test_a_tool_call_written_inside_the_block_is_not_run(folders):
    model = FreeTokenModel(Engine.from_pretrained(folders(QWEN3)))
    thought = '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'
    prefix = f"<think>\nMaybe {thought}\n</think>\n\nNo."
    request = GenerateRequest(prefix=prefix, tools=[ADD], max_new_tokens=1, temperature=0)
    text, reasoning, events = turn(model, request)
    assert thought in reasoning and text.startswith("No.")
    assert not [e for e in events if e.kind == "anchor" and e.anchor.kind == "tool_call"]


def test_a_prompt_that_opens_the_block_makes_the_turn_reasoning_until_it_closes(folders):
    model = FreeTokenModel(Engine.from_pretrained(folders(OPENS_THE_BLOCK)))
    text, reasoning, _ = turn(model, GenerateRequest(max_new_tokens=6, temperature=0))
    assert reasoning.strip() and text == ""  # the random model never writes </think>


def test_templates_without_blocks_keep_every_token_as_text():
    model = FreeTokenModel(
        Engine.from_pretrained(
            Path(__file__).parent.parent / "freetoken_agents" / "data" / "freetoken-tiny.ftw"
        )
    )
    assert model.reasoning is None
    text, reasoning, _ = turn(model, GenerateRequest(prefix="<think>\nhm\n</think>\n", max_new_tokens=2))
    assert reasoning == "" and text.startswith("<think>")


def test_the_server_returns_reasoning_content_apart(folders):
    with running_server(engine=Engine.from_pretrained(folders(OPENS_THE_BLOCK))) as server:
        client = server.client()
        reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
        message = reply.choices[0].message.model_dump()
        assert message["reasoning_content"] and not message["content"]
        stream = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=6, temperature=0, stream=True
        )
        deltas = [c.choices[0].delta.model_dump() for c in stream if c.choices]
        streamed = "".join(d.get("reasoning_content") or "" for d in deltas)
        assert streamed == message["reasoning_content"]
        assert not "".join(d.get("content") or "" for d in deltas)


def test_chatfreetoken_puts_reasoning_in_additional_kwargs(folders):
    chat = ChatFreeToken(model=str(folders(OPENS_THE_BLOCK)), max_tokens=6, temperature=0)
    message = chat.invoke("What is 2 + 3?")
    assert message.additional_kwargs["reasoning_content"] and message.content == ""
    chunks = list(chat.stream("What is 2 + 3?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert merged.additional_kwargs["reasoning_content"] == message.additional_kwargs["reasoning_content"]


def test_the_agents_answer_leaves_the_block_out(folders):
    from freetoken_agents import Agent

    model = FreeTokenModel(Engine.from_pretrained(folders(OPENS_THE_BLOCK)))
    result = Agent(model, max_new_tokens=6, temperature=0).run("What is 2 + 3?")
    assert result.trace.tokens_decoded > 0  # it wrote: all of it inside the block, never closed
    assert result.output == ""  # the old Agent answered with the block's text
