"""The SDK's decoders on CUDA logits (the embedded model on the GPU): forced calls, a long free
turn with anchors, and budgeted structured output give what they give on the CPU. Skipped without
a GPU (checked on the H200: identical outputs)."""

from __future__ import annotations

import json

import pytest
import torch

from freetoken_agents import FreeTokenModel, GenerateRequest, default_model
from freetoken_agents.recipes.tiny.world import get_weather, multiply

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GET_WEATHER, MULTIPLY = get_weather.json_schema(), multiply.json_schema()
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["x", "tags"],
}


def _outputs(device: str) -> dict:
    model = FreeTokenModel.from_pretrained(default_model(), device=device)

    def turn(question: str, tools: list, **request) -> str:
        model.reset()
        model.sync(model.render([{"role": "user", "content": question}], tools))
        events = model.generate(GenerateRequest(tools=tools, **request))
        return "".join(e.text for e in events if e.kind == "text")

    no_call = {t: -1e4 for t in (*model.stop_ids, model.tokenizer.convert_tokens_to_ids("<tool_call>"))}
    model.reset()
    model.sync(model.render([{"role": "user", "content": "A point"}], None))
    point = "".join(e.text for e in model.decode_json(POINT, max_tokens=8) if e.kind == "text")
    return {
        "paris": turn("What is the weather in Paris?", [GET_WEATHER], force="get_weather"),
        "product": turn("What is 12 times 7?", [MULTIPLY], force="multiply"),
        "story": turn("Tell me a story", [GET_WEATHER], max_new_tokens=200, logit_bias=no_call),
        "point": point,
    }


def test_sdk_decoding_on_cuda_matches_the_cpu() -> None:
    on_gpu, on_cpu = _outputs("cuda"), _outputs("cpu")
    assert '"city": "Paris"' in on_gpu["paris"] and '"a": 12, "b": 7' in on_gpu["product"]
    assert set(json.loads(on_gpu["point"])) == {"x", "tags"}
    assert on_gpu == on_cpu
