"""The engine renders chat templates itself, in its budgeted sandbox (`engine.template.sandbox`):
every real template of `real_templates` must give exactly the text of transformers'
`apply_chat_template(..., tokenize=False)`, with and without tools, with a tool call and its
result, with reasoning, with the generation prompt on and off; a template transformers refuses
is refused too (a ChatTemplateError)."""

from __future__ import annotations

from typing import Any

import pytest
import transformers
from real_templates import CACHE, real_template
from serve_harness import TOOLS
from tokenizers import Tokenizer, models

from freetoken_agents.engine import ChatTemplateError, render_chat

# the templates of the cached sdist (one template, which fetches it, when nothing is cached yet)
TEMPLATES = sorted(p.stem for p in CACHE.glob("*.jinja")) or ["Qwen-Qwen3-0.6B"]
MULTIPLY = {"name": "multiply", "arguments": {"a": 6, "b": 7}}
CALL = {"id": "abcDEF123", "type": "function", "function": MULTIPLY}
ASK = [{"role": "system", "content": "Be brief.\n"}, {"role": "user", "content": " What is 6 times 7?"}]
CASES: dict[str, tuple[list[dict[str, Any]], Any]] = {
    "chat": (ASK, None),
    "tools": (ASK, TOOLS),
    "call-and-result": (
        [
            *ASK,
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "abcDEF123", "name": "multiply", "content": "42"},
        ],
        TOOLS,
    ),
    "reasoning": (
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning_content": "greet back", "tool_calls": None},
            {"role": "user", "content": "bye"},
        ],
        None,
    ),
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """A transformers tokenizer with the named special tokens templates read (bos, eos...)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )


@pytest.mark.parametrize("name", TEMPLATES)
def test_every_real_template_renders_as_transformers_does(tokenizer, name):
    tokenizer.chat_template = real_template(name)
    for case, (messages, tools) in CASES.items():
        for generation in (True, False):
            where = f"{name}, {case}, add_generation_prompt={generation}"
            try:
                want = tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=generation, tokenize=False
                )
            except Exception:  # the template refuses these messages (a role order, no tools...)
                with pytest.raises(ChatTemplateError):
                    render_chat(tokenizer, messages, tools, add_generation_prompt=generation)
                continue
            assert render_chat(tokenizer, messages, tools, add_generation_prompt=generation) == want, where
