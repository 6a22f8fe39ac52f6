"""The engine's prompts held to `transformers`' `apply_chat_template`, token for token, for the real
chat templates of Qwen3, Qwen3-Coder, gpt-oss, DeepSeek-V3.1 and Mistral Nemo with real tokenizers
(`real_tokenizers.py` says where each comes from): system + user + tools with the generation
prompt, then an assistant tool call and its tool result (issue 35). The engine renders with
untrusted spans (`engine.chat.render_chat_spans`, `engine.tokenize.encode_segments`); with contents
that hold no control-token text it must give exactly the tokenizer's own ids."""

from __future__ import annotations

from typing import Any

import pytest
from real_templates import real_template
from real_tokenizers import real_tokenizer
from serve_harness import TOOLS, shared_engine

from freetoken_agents import FreeTokenModel
from freetoken_agents.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [
    ("Qwen-Qwen3-0.6B", "qwen3"),
    ("Qwen3-Coder", "qwen3"),
    ("openai-gpt-oss-120b", "gpt-oss"),
    ("deepseek-ai-DeepSeek-V3.1", "deepseek-v3"),
    ("mistralai-Mistral-Nemo-Instruct-2407", "mistral-nemo"),
]
CALL_ID = "abcDEF123"  # the form Mistral's templates demand; the others take any string
# contents whose edges a span-wise tokenization would get wrong: newlines that merge with the
# template's own, leading spaces, digits, non-ASCII
SYSTEM = "You are a careful assistant.\n\n  Answer briefly."
USER = "\n\nWhat is 6 times 7?  Answer in façade-style ünïcode, please.\n"
RESULT = "\n 42\n\n"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(shared_engine().source)


def conversation(with_call: bool) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER},
    ]
    if with_call:
        function = {"name": "multiply", "arguments": {"a": 6, "b": 7}}
        call = {"id": CALL_ID, "type": "function", "function": function}
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": CALL_ID, "name": "multiply", "content": RESULT},
        ]
    return messages


def reference_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(t) for t in ids]


@pytest.mark.parametrize("with_call", [False, True], ids=["tools", "call-and-result"])
@pytest.mark.parametrize(("template", "tokenizer_name"), CASES, ids=[c[0] for c in CASES])
def test_prompt_ids_equal_transformers(engine, template, tokenizer_name, with_call):
    tokenizer = real_tokenizer(tokenizer_name)
    tokenizer.chat_template = real_template(template)
    engine._tokenizer = tokenizer  # rendering reads the tokenizer only; the weights never run
    messages = conversation(with_call)
    expected = reference_ids(tokenizer, messages)
    assert engine.apply_chat_template(messages, TOOLS) == expected
    model = FreeTokenModel(engine)
    try:
        assert model.render(messages, TOOLS) == expected
    finally:
        model.close()
    controls = set(tokenizer.get_added_vocab().values())
    assert controls & set(expected)  # the markup is the tokenizer's control tokens, not their text
