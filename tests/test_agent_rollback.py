"""Rollback on the REAL engine (tiny random qwen3_moe): token and KV effects, saved-token counts,
and the rebuild-by-prefill path when an anchor fails validation."""

from __future__ import annotations

from typing import Literal

import pytest
import torch
from tiny_models import build_tiny_model, fresh_logits

from freetoken_agents import Agent, FreeTokenModel, RetryPolicy, tool
from freetoken_agents.engine import Engine

FAST = RetryPolicy(initial_backoff=0.0, max_backoff=0.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("agent_q3"), max_position_embeddings=4096)
    return Engine.from_pretrained(path)


def corrupt_anchor_kv(engine: Engine, native_anchor) -> None:
    """Flip KV bytes in the anchor's first block so signature validation fails."""
    block = native_anchor.blocks[0]
    with torch.inference_mode():
        for tensor in engine.kv_pool.storage[0].values():
            tensor[block] += 1.0


def test_failed_call_is_rolled_back_and_retried(engine: Engine) -> None:
    model = FreeTokenModel(engine)
    seen: list[list[int]] = []

    @tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> dict:
        "Current weather."
        seen.append(model.token_ids)  # the context when the tool runs
        if len(seen) == 1:
            raise ValueError("upstream rejected the city")
        return {"city": city, "temperature": 21}

    agent = Agent(
        model,
        [get_weather],
        system_prompt="Be brief.",
        tool_choice="required",
        retry=FAST,
        max_new_tokens=4,
        max_steps=2,
        isolate_runs=False,  # on the model's own context, read in the tool and after the run
    )
    result = agent.run("Weather in Paris?")
    trace = result.trace

    assert len(seen) == 2 and len(trace.rollbacks) == 1
    first_call = next(a for a in trace.anchors if a.kind == "tool_call")
    p = first_call.position
    rb = trace.rollbacks[0]
    assert (rb.to_position, rb.rebuilt) == (p, False)
    # The context the retried call ran in = the anchor's prefix + the failure note + the new call.
    note = FAST.note(
        attempt=1,
        tool="get_weather",
        arguments={"city": "Paris"},
        error=ValueError("ValueError: upstream rejected the city"),
    )
    note_ids = engine.tokenizer.encode(note, add_special_tokens=False)
    assert seen[1][:p] == seen[0][:p]
    assert seen[1][p : p + len(note_ids)] == note_ids
    # The failed attempt's tokens are gone: what followed the anchor then is not there now.
    failed_tail = seen[0][p:]
    assert seen[1][p : p + len(failed_tail)] != failed_tail
    assert rb.tokens_discarded == len(failed_tail) - 1 + 1  # the call and its pending stop token
    # Saved = the prefix a re-send would have recomputed.
    assert trace.tokens_saved_by_rollback == p == rb.tokens_saved
    assert model.usage().saved_by_rollback == p
    kinds = [a.kind for a in trace.anchors]
    assert kinds[0] == "system_prompt" and kinds.count("tool_call") == 2 and "tool_result" in kinds
    assert [r.scope for r in trace.retries] == ["model"]
    # The KV the run ended with (built on the rolled-back cache) equals a fresh prefill.
    torch.testing.assert_close(
        model.next_logits(), fresh_logits(engine, model.token_ids), rtol=1e-4, atol=1e-4
    )


def test_kv_after_rollback_equals_fresh_prefill(engine: Engine) -> None:
    model = FreeTokenModel(engine)
    ids = model.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None)
    model.sync(ids)
    anchor = model.anchor("manual")
    model.append_text('<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>')
    prefilled = model.usage().prefilled
    outcome = model.rollback(anchor)
    assert not outcome.rebuilt and model.token_ids == ids
    assert model.usage().prefilled == prefilled  # rollback is pointer work: nothing recomputed
    model.append_text("[attempt 1 failed]\n")
    torch.testing.assert_close(
        model.next_logits(), fresh_logits(engine, model.token_ids), rtol=1e-4, atol=1e-4
    )


def test_anchor_validation_failure_rebuilds_by_prefill(engine: Engine) -> None:
    model = FreeTokenModel(engine)
    ids = model.render([{"role": "user", "content": "Hello there"}], None)
    model.sync(ids)
    anchor = model.anchor("manual")
    model.append_text("some tokens after the anchor")
    corrupt_anchor_kv(engine, anchor.native)
    before = model.usage().prefilled
    outcome = model.rollback(anchor)
    assert outcome.rebuilt and model.token_ids == ids
    assert model.usage().prefilled - before == len(ids)  # the prefix was re-prefilled
    torch.testing.assert_close(model.next_logits(), fresh_logits(engine, ids), rtol=1e-4, atol=1e-4)


def test_agent_records_rebuild_when_anchor_is_corrupted(engine: Engine) -> None:
    model = FreeTokenModel(engine)
    calls = {"n": 0}

    @tool
    def lookup(key: Literal["a", "b"]) -> str:
        "Look a key up."
        calls["n"] += 1
        if calls["n"] == 1:
            anchor = list(model.anchors)[-1]  # the anchor before this call
            corrupt_anchor_kv(engine, anchor.native)
            raise KeyError(key)
        return "found"

    agent = Agent(  # on the model's own context: its anchors and KV are read in the tool and after
        model, [lookup], tool_choice="lookup", retry=FAST, max_new_tokens=2, max_steps=2, isolate_runs=False
    )
    result = agent.run("Look up a")
    (rb,) = result.trace.rollbacks
    assert rb.rebuilt and rb.tokens_saved == 0 and result.trace.tokens_saved_by_rollback == 0
    assert result.trace.tool_calls[0].result == "found"
    torch.testing.assert_close(
        model.next_logits(), fresh_logits(engine, model.token_ids), rtol=1e-4, atol=1e-4
    )


def test_rebuilt_anchor_stays_usable_and_old_record_is_discarded(engine: Engine) -> None:
    model = FreeTokenModel(engine)
    ids = model.render([{"role": "user", "content": "Hello again"}], None)
    model.sync(ids)
    anchor = model.anchor("manual")
    old_native = anchor.native
    model.append_text("first detour")
    corrupt_anchor_kv(engine, old_native)
    assert model.rollback(anchor).rebuilt
    assert old_native.id not in engine.anchors or engine.anchors.get(old_native.id) is not old_native
    held = model.anchors.get(anchor.id)
    assert held is not None and held.native is not None and held.native is not old_native
    # The caller's (old) handle still works, now by pointer work on the rebuilt record.
    model.append_text("second detour")
    prefilled = model.usage().prefilled
    outcome = model.rollback(anchor)
    assert not outcome.rebuilt and model.token_ids == ids and model.usage().prefilled == prefilled
    model.reset()
    assert held.native.id not in engine.anchors  # reset discards the model's anchors


# ---- validate: set on the model or the agent, honoured by every rollback -----------------------------
def corrupt_middle_block(engine: Engine, native_anchor) -> None:
    """Flip KV bytes in a block the signature does not read (neither the first nor the last)."""
    blocks = native_anchor.blocks
    assert len(blocks) >= 3
    with torch.inference_mode():
        for tensor in engine.kv_pool.storage[0].values():
            tensor[blocks[len(blocks) // 2]] += 1.0


LONG = "Be brief. " * 12  # enough tokens for an anchor over several KV blocks


@pytest.mark.parametrize(("mode", "rebuilt"), [("signature", False), ("full", True)])
def test_model_validate_reaches_the_engine(engine: Engine, mode: str, rebuilt: bool) -> None:
    """ "signature" reads the KV's edges only, so a corrupt middle block passes it; "full" rehashes
    every block and catches it (the rollback then rebuilds by prefill)."""
    model = FreeTokenModel(engine, validate=mode)
    ids = model.render([{"role": "system", "content": LONG}, {"role": "user", "content": "Hi"}], None)
    model.sync(ids)
    anchor = model.anchor("manual")
    model.append_text("a detour")
    corrupt_middle_block(engine, anchor.native)
    assert model.rollback(anchor).rebuilt is rebuilt
    assert model.token_ids == ids
    # The per-call argument overrides the model's setting.
    again = model.anchor("manual")
    corrupt_middle_block(engine, again.native)
    model.append_text("another detour")
    assert model.rollback(again, validate="full").rebuilt


def test_agent_validate_reaches_its_rollbacks(engine: Engine) -> None:
    model = FreeTokenModel(engine, validate="signature")  # the agent's setting wins
    calls = {"n": 0}

    @tool
    def lookup(key: Literal["a", "b"]) -> str:
        "Look a key up."
        calls["n"] += 1
        if calls["n"] == 1:
            corrupt_middle_block(engine, list(model.anchors)[-1].native)  # the anchor before this call
            raise KeyError(key)
        return "found"

    agent = Agent(  # on the model's own context: its anchors and KV are read in the tool and after
        model,
        [lookup],
        system_prompt=LONG,
        tool_choice="lookup",
        retry=FAST,
        max_steps=2,
        validate="full",
        isolate_runs=False,
    )
    result = agent.run("Look up a")
    (rb,) = result.trace.rollbacks
    assert rb.rebuilt and result.trace.tool_calls[0].result == "found"
    torch.testing.assert_close(
        model.next_logits(), fresh_logits(engine, model.token_ids), rtol=1e-4, atol=1e-4
    )
