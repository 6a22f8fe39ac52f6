"""One engine, many callers: sessions in different threads get exactly their one-at-a-time
results (each step holds the engine lock, never across steps), and a generation stopped by a
memory limit returns what it produced with finish_reason "memory"."""

from __future__ import annotations

import threading

import pytest

from freetoken_agents.engine import Engine, MemoryBudget, MemoryBudgetError

pytestmark = pytest.mark.usefixtures("one_thread")


def prompts(vocab: int) -> list[list[int]]:
    # 2 x (120 + 40) tokens outgrow the pool's first 16 blocks of 16: it grows while both run.
    return [[(7 * i + 3) % vocab for i in range(120)], [(11 * i + 5) % vocab for i in range(120)]]


class StepProbe:
    """Counts model forward passes running at the same time (hooks run in the caller's thread)."""

    def __init__(self, engine: Engine) -> None:
        self.active = self.peak = self.steps = 0
        self._lock = threading.Lock()
        engine.model.register_forward_pre_hook(self._enter)
        engine.model.register_forward_hook(self._leave)

    def _enter(self, *_: object) -> None:
        with self._lock:
            self.active += 1
            self.steps += 1
            self.peak = max(self.peak, self.active)

    def _leave(self, *_: object) -> None:
        with self._lock:
            self.active -= 1


def test_two_threads_generating_on_one_fresh_engine_get_their_one_at_a_time_outputs(tiny_checkpoint):
    """The bug: with nothing serialising steps, two threads' forward passes overlapped (both
    write the KV pool, which may grow meanwhile): a RuntimeError in BlockPool._grow or a silently
    different output in some runs. Each step now holds the engine lock, so steps never overlap."""
    folder = tiny_checkpoint("qwen3_moe")
    alone = Engine.from_pretrained(folder)
    wanted = [
        alone.generate(p, max_new_tokens=40, stop_token_ids=()).token_ids
        for p in prompts(alone.spec.vocab_size)
    ]
    for _ in range(20):
        engine = Engine.from_pretrained(folder)  # fresh: its KV pool has to grow under both threads
        probe = StepProbe(engine)
        got: list[list[int] | BaseException] = [[], []]
        start = threading.Barrier(2)

        def run(i: int, engine: Engine = engine, got: list = got, start: threading.Barrier = start) -> None:
            try:
                start.wait()
                ids = prompts(engine.spec.vocab_size)[i]
                got[i] = engine.generate(ids, max_new_tokens=40, stop_token_ids=()).token_ids
            except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                got[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == wanted
        assert probe.steps == 2 * 40 and probe.peak == 1  # every step ran alone
        assert engine.kv_pool.blocks_in_use == 0


def test_generation_stopped_by_the_kv_budget_returns_what_it_produced(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_moe")
    free = Engine.from_pretrained(folder)
    bounded = Engine.from_pretrained(folder, memory=MemoryBudget(kv_bytes=3 * free.kv_pool.bytes_per_block))
    prompt = [5, 9, 2, 7, 1, 3, 8, 4, 6, 10]  # 10 tokens; 3 blocks of 16 hold 48
    full = free.generate(prompt, max_new_tokens=60, stop_token_ids=())
    cut = bounded.generate(prompt, max_new_tokens=60, stop_token_ids=())
    assert cut.finish_reason == "memory"
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert len(prompt) + len(cut.token_ids) == 3 * 16 + 1  # every token that fit, plus the last one sampled
    with pytest.raises(MemoryBudgetError, match="KV cache is full"):
        bounded.generate(list(range(1, 60)), max_new_tokens=4)  # a prompt that does not fit: nothing produced
