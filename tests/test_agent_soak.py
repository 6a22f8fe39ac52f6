"""Soak: many forced tool calls on the REAL engine (tiny random qwen3_moe), some failing and rolled
back, with memory flat: KV blocks, anchors (engine store and agent book), anchor bytes within the
store's budget, and the Python heap.

200 calls by default; `FREETOKEN_SOAK_CALLS=1000 pytest tests/test_agent_soak.py` for the long run.
"""

from __future__ import annotations

import gc
import os
import tracemalloc

import pytest
from tiny_models import build_tiny_model

from freetoken_agents import Agent, FreeTokenModel, RetryPolicy, tool
from freetoken_agents.engine import Engine

CALLS = int(os.environ.get("FREETOKEN_SOAK_CALLS", "200"))
PER_RUN = 25  # tool calls per run (one context); then a final answer and a fresh run
MAX_ANCHORS = 16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = build_tiny_model("qwen3_moe", tmp_path_factory.mktemp("agent_soak"), max_position_embeddings=4096)
    return Engine.from_pretrained(path)


def test_tool_call_soak_keeps_memory_flat(engine: Engine) -> None:
    model = FreeTokenModel(engine, max_anchors=MAX_ANCHORS)
    block_bytes = engine.kv_pool.bytes_per_block
    engine.anchors.byte_budget = budget = 64 * block_bytes
    runs = {"n": 0}

    @tool
    def ping() -> str:
        "Ping the service."
        runs["n"] += 1
        if runs["n"] % 10 == 0:
            raise ValueError("the service is warming up")  # model-caused: rollback and retry
        return "pong"

    agent = Agent(
        model,
        [ping],
        tool_choice=lambda step: "ping" if step <= PER_RUN else "none",
        retry=RetryPolicy(initial_backoff=0.0, max_backoff=0.0),
        max_new_tokens=1,
        max_steps=PER_RUN + 1,
    )
    samples: list[tuple[int, int, int]] = []  # (KV blocks, engine anchors, heap bytes) after each run
    calls = rollbacks = 0
    tracemalloc.start()
    try:
        while calls < CALLS:
            result = agent.run("ping the service")
            calls += len(result.trace.tool_calls)
            rollbacks += len(result.trace.rollbacks)
            assert len(engine.anchors) <= MAX_ANCHORS and len(model.anchors) <= MAX_ANCHORS
            assert engine.anchors.used_bytes <= budget
            del result
            gc.collect()
            samples.append(
                (engine.kv_pool.blocks_in_use, len(engine.anchors), tracemalloc.get_traced_memory()[0])
            )
    finally:
        tracemalloc.stop()
        engine.anchors.byte_budget = None
    assert calls >= CALLS and rollbacks >= calls // 10 - PER_RUN
    blocks = [b for b, _, _ in samples[1:]]
    heap = [h for _, _, h in samples[1:]]
    half = len(blocks) // 2
    # Runs differ only in where their retries fall: KV in use does not trend up, and stays within
    # one context's worth of blocks plus what the anchor budget allows.
    assert max(blocks[half:]) <= max(blocks[:half]) + 2
    context_blocks = -(-engine.max_context // engine.kv_pool.block_size)
    assert max(blocks) <= context_blocks + budget // block_bytes
    assert max(heap) - heap[0] < 512 * 1024  # no per-run growth of the Python heap
    model.reset()
    assert len(engine.anchors) == 0  # the model's anchors leave the store with it
