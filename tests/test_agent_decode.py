"""Mid-turn decoding on the REAL engine (tiny random qwen3_moe): code-block anchors, the
tool_choice='auto' switch to constrained arguments, and decoding off the event loop."""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Literal

import pytest
import torch
from tiny_models import build_tiny_model, fresh_logits

from freetoken_agents import Agent, FreeTokenModel, GenerateRequest, RetryPolicy, tool
from freetoken_agents._fences import FenceDetector, fence_held_back, opening_fences
from freetoken_agents.constrained import JsonConstraint
from freetoken_agents.engine import Engine

TOOL_CALL_ID = 3  # "<tool_call>" in the tiny tokenizer (special tokens come first)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("agent_dec"), max_position_embeddings=4096)
    return Engine.from_pretrained(path)


# ---- the fence detector, on any split of the text ---------------------------------------------------
TEXT = "Intro with ``` inline\n```python\nx = 1\n```\nthen\n  ````\n```\nstill code\n````\n"
FENCES = [TEXT.index("```python"), TEXT.index("  ````") + 2]  # the inline run opens nothing


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, len(TEXT)])
def test_fence_detector_on_split_tokens(size: int) -> None:
    assert opening_fences(TEXT) == FENCES
    detector, found, text = FenceDetector(), [], ""
    for i in range(0, len(TEXT), size):
        text += TEXT[i : i + size]
        found += [(j, len(text)) for j in detector.feed(TEXT[i : i + size])]
        assert detector.held_back == fence_held_back(text)
    assert [j for j, _ in found] == FENCES
    # Each fence is reported by the first piece that completes its third backtick.
    assert all(seen - j <= 2 + size for j, seen in found)
    assert fence_held_back("a\n``") == 2 and fence_held_back("a ``") == 0 and fence_held_back("a\n```") == 0
    assert fence_held_back("``") == 2 and fence_held_back("a\n    `") == 0 and fence_held_back("\n   `") == 1


@pytest.mark.parametrize("seed", range(40))
def test_fence_detector_agrees_with_the_stateless_scan(seed: int) -> None:
    """Random texts of backticks, spaces, newlines and letters, fed in random pieces: the stream
    reports exactly the fences a whole-text scan finds."""
    rng = random.Random(seed)
    text = "".join(rng.choice("```` \n\nab") for _ in range(rng.randint(20, 200)))
    detector, found, i = FenceDetector(), [], 0
    while i < len(text):
        step = rng.randint(1, 6)
        found += detector.feed(text[i : i + step])
        i += step
    assert found == opening_fences(text), repr(text)


# ---- code-block anchors on the engine ---------------------------------------------------------------
def test_code_block_anchor_sits_before_the_fence(engine: Engine) -> None:
    model = FreeTokenModel(engine)
    prefix = "Here:\n```python\n"  # forced, token by token, through the same checks as sampled text
    # isolate_runs=False: the run leaves its context on the model, read below
    agent = Agent(
        model,
        system_prompt="Be brief.",
        max_new_tokens=4,
        model_settings={"prefix": prefix},
        isolate_runs=False,
    )
    events = list(agent.stream("Show me code"))
    trace = events[-1].data.trace
    (code,) = [a for a in trace.anchors if a.kind == "code_block"]
    ids, tok = model.token_ids, engine.tokenizer
    turn_start = trace.anchors[0].position  # the system prompt anchor, then the user turn
    assert tok.decode(ids[code.position : code.position + 3]) == "```"
    assert tok.decode(ids[: code.position]).endswith("<|im_start|>assistant\nHere:\n")
    assert turn_start < code.position
    # Streamed in order: the text before the fence, then the anchor, then the fence.
    kinds = [(e.kind, e.data if e.kind == "text" else None) for e in events if e.step == 1]
    at = kinds.index(("anchor", None), 1)
    assert "".join(d for k, d in kinds[:at] if k == "text") == "Here:\n"
    assert events[-1].data.output.startswith(prefix.strip())
    # The anchor's cut-and-replay left the KV exactly as a fresh prefill of the same tokens.
    torch.testing.assert_close(model.next_logits(), fresh_logits(engine, ids), rtol=1e-4, atol=1e-4)


# ---- tool_choice="auto": a call start mid-stream switches to constrained arguments --------------------
def test_auto_call_start_switches_to_constrained_arguments(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = FreeTokenModel(engine)
    masked = {"n": 0}
    mask = JsonConstraint.mask_

    def counting_mask(self: JsonConstraint, logits: torch.Tensor) -> torch.Tensor:
        masked["n"] += 1
        return mask(self, logits)

    monkeypatch.setattr(JsonConstraint, "mask_", counting_mask)
    generate, turns = model.generate, []

    def first_turn_starts_a_call(request: GenerateRequest):  # the model "decides" to call
        turns.append(request)
        if len(turns) == 1:
            request = request.model_copy(update={"logit_bias": {TOOL_CALL_ID: 100.0}})
        return generate(request)

    monkeypatch.setattr(model, "generate", first_turn_starts_a_call)
    seen: list[dict] = []

    @tool
    def get_weather(city: Literal["Paris", "Tokyo"], unit: Literal["c", "f"] = "c") -> str:
        "Current weather."
        seen.append({"city": city, "unit": unit})
        return "sunny"

    @tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        "Current time."
        seen.append({"zone": zone})
        return "noon"

    agent = Agent(  # on the model's own context, whose generate is patched above
        model, [get_weather, get_time], max_new_tokens=3, max_steps=3, retry=RetryPolicy(), isolate_runs=False
    )
    result = agent.run("Weather in Paris?")
    assert turns[0].force is None and agent.tool_choice == "auto"  # the auto path, nothing forced
    call_anchor = next(a for a in result.trace.anchors if a.kind == "tool_call")
    assert call_anchor.step == 1 and call_anchor.label is None  # the model picks the tool
    (call,) = result.trace.tool_calls[:1]
    tool_obj = {"get_weather": get_weather, "get_time": get_time}[call.tool]
    tool_obj.validate(call.arguments)  # the constrained arguments validate
    assert seen and result.trace.retries == [] and masked["n"] > 0
    assert result.trace.steps[0].tokens_decoded >= masked["n"]  # masked tokens were decoded ones


# ---- async: the engine steps run off the event loop ---------------------------------------------------
def test_other_coroutines_run_while_the_agent_decodes(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each decode step waits until a coroutine on the event loop has run: if steps ran on the
    loop's thread (or blocked it) the first wait would never end. No timing is measured; the
    timeout only bounds how long a broken build takes to fail."""
    model = FreeTokenModel(engine)
    threads: set[int] = set()
    loop_ran = threading.Event()
    waits: list[bool] = []
    decode = model.decode

    def watched_decode(token_id: int) -> None:
        threads.add(threading.get_ident())
        loop_ran.clear()
        waits.append(loop_ran.wait(timeout=60))  # the loop must run while this step is in progress
        decode(token_id)

    monkeypatch.setattr(model, "decode", watched_decode)
    agent = Agent(model, system_prompt="Be brief.", max_new_tokens=12)

    async def main() -> None:
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                loop_ran.set()
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        try:
            await agent.arun("Tell me a story")
        finally:
            stop.set()
            await task

    asyncio.run(main())
    assert threading.get_ident() not in threads and len(threads) == 1
    assert len(waits) >= 5 and all(waits)


# ---- linear-time turns --------------------------------------------------------------------------------
def test_detokenizer_work_per_token_does_not_grow_with_the_turn(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn decoder decodes a short window per token, not the whole turn (which made a turn
    quadratic): the ids handed to the tokenizer stay proportional to the tokens generated."""
    model = FreeTokenModel(engine)
    decoded = {"ids": 0}
    decode = model.tokenizer.decode

    def counting(ids, **kwargs):
        decoded["ids"] += len(ids)
        return decode(ids, **kwargs)

    monkeypatch.setattr(model.tokenizer, "decode", counting)
    model.sync(model.render([{"role": "user", "content": "Tell me a long story"}], None))
    no_stop = {t: -1e4 for t in model.stop_ids}
    request = GenerateRequest(max_new_tokens=400, logit_bias=no_stop)
    events = list(model.generate(request))
    assert events[-1].finish_reason == "length"
    assert decoded["ids"] <= 16 * 400  # re-decoding the turn each token: ~400 * 400 / 2


def test_a_turn_stops_where_the_context_ends(engine: Engine) -> None:
    """Free text ends with "length" at the context's end (room kept for the stop token) instead of
    raising ContextOverflowError from inside the engine."""
    model = FreeTokenModel(engine)
    model.prefill([7] * (engine.max_context - 6))
    no_stop = {t: -1e4 for t in model.stop_ids}
    events = list(model.generate(GenerateRequest(max_new_tokens=50, logit_bias=no_stop)))
    assert events[-1].finish_reason == "length"
    assert engine.max_context - 2 <= model.position <= engine.max_context - 1
