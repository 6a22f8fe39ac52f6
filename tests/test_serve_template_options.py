"""vLLM's chat-template options through `freetoken serve` (issue 63, item 6): `continue_final_message`
(the reply continues the last assistant message: the prompt ends after its text, without the
template's end of turn, exactly as transformers' `apply_chat_template(continue_final_message=True)`
renders it) and `chat_template_kwargs` (variables for the chat template, as transformers'
`apply_chat_template(**kwargs)` passes them: Qwen3's `enable_thinking`; a key the template does not
read changes nothing, as in vLLM)."""

from __future__ import annotations

import openai
import pytest
from real_templates import model_with_template
from serve_harness import MODEL

from freetoken_agents.integrations.openai_server.prepare import check, prepare
from freetoken_agents.integrations.openai_server.schemas import ChatCompletionRequest

pytestmark = pytest.mark.usefixtures("one_thread")

HI = [{"role": "user", "content": "What is the weather in Paris?"}]
STARTED = [*HI, {"role": "assistant", "content": "The weather in Paris is"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def create(client, messages=HI, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=6, extra_body=extra
    )


def refused(client, param: str, messages=HI, **extra) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        create(client, messages, **extra)
    assert info.value.body["param"] == param, info.value.body
    return info.value.body["message"]


def test_continue_final_message_prompt_ends_inside_the_assistant_message(client, server):
    closed = create(client, STARTED, add_generation_prompt=False)  # the message and its <|im_end|>\n
    opened = create(client, STARTED, **CONTINUE)
    suffix = server.engine.tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
    assert opened.usage.prompt_tokens == closed.usage.prompt_tokens - len(suffix)
    assert opened.choices[0].message.content  # the continuation alone, as vLLM returns it


@pytest.mark.parametrize(
    "template",
    [
        "Qwen-Qwen2.5-7B-Instruct",
        "Qwen-Qwen3-0.6B",  # writes an empty think block before the continued text
        "meta-llama-Llama-3.1-8B-Instruct",  # trims the text: the trailing space goes too
        "mistralai-Mistral-Nemo-Instruct-2407",  # nothing after [/INST]'s answer but </s>
        "openai-gpt-oss-120b",
        "ibm-granite-granite-3.3-2B-Instruct",
    ],
)
def test_continue_final_message_prompt_is_transformers_own(template):
    """The reference: transformers' apply_chat_template(continue_final_message=True) on the same
    tokenizer and template."""
    model = model_with_template(template)
    messages = [*HI, {"role": "assistant", "content": "It is sunny and "}]
    request = ChatCompletionRequest.model_validate({"messages": messages, **CONTINUE})
    prepared = prepare(check(request, model, model_name=MODEL), model)
    ours = model.tokenizer.decode(prepared.ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert ours == model.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)


@pytest.mark.parametrize(
    "messages, extra, words",
    [
        (STARTED, {"continue_final_message": True}, "add_generation_prompt: false"),  # vLLM's rule
        (HI, CONTINUE, "must be the assistant's, got user"),
        (
            [*HI, {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}],
            CONTINUE,
            "tool calls",
        ),
        (STARTED, {"continue_final_message": "yes", "add_generation_prompt": False}, "true or false"),
    ],
)  # fmt: skip
def test_continue_final_message_misuse_is_a_400_naming_it(client, messages, extra, words):
    assert words in refused(client, "continue_final_message", messages, **extra)


def test_template_kwargs_the_template_does_not_read_change_nothing(client):
    # the embedded model's ChatML template has no thinking switch: vLLM would drop the key too
    plain = create(client)
    same = create(client, chat_template_kwargs={"enable_thinking": False, "custom_flag": [1, {"a": 2}]})
    assert same.usage.prompt_tokens == plain.usage.prompt_tokens
    assert same.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ([1], "chat_template_kwargs"),
        ("enable_thinking=false", "chat_template_kwargs"),
        ({"messages": []}, "chat_template_kwargs.messages"),  # the render sets it
        ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ],
)
def test_malformed_template_kwargs_are_a_400_naming_them(client, kwargs, param):
    refused(client, param, chat_template_kwargs=kwargs)


@pytest.mark.parametrize("thinking", [False, True])
def test_a_template_kwarg_reaches_the_template_as_transformers_passes_it(thinking):
    """Qwen3's template reads `enable_thinking`: false writes an empty think block after the
    assistant header. The prompt is the tokens of transformers' own rendering with the kwarg."""
    model = model_with_template("Qwen-Qwen3-0.6B")
    body = {"messages": HI, "chat_template_kwargs": {"enable_thinking": thinking}}
    prepared = prepare(check(ChatCompletionRequest.model_validate(body), model, model_name=MODEL), model)
    assert prepared is not None
    text = model.tokenizer.apply_chat_template(
        HI, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
    )
    assert prepared.ids == model.tokenizer.encode(text, add_special_tokens=False)
    assert text.endswith("<think>\n\n</think>\n\n") != thinking
