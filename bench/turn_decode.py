"""SDK time per generated token in one long turn: is the turn decoder linear?

    python bench/turn_decode.py [--lengths 64 512 2048] [--repeats 3] [--threads 1]

One `Agent.run` whose single turn generates N tokens (N = each of --lengths), on two backends:

- scripted: `freetoken_agents.testing.ScriptedModel` playing an N-character answer (one
  character per streamed event) with code fences in it; no model at all, so the whole time is
  the SDK's (agent loop, events, anchors at fences, parsing).
- embedded: the embedded trained model (`freetoken_agents.default_model()`) through
  `FreeTokenModel` and the turn decoder, a tool offered (call-marker search on) and stop tokens
  and the call marker biased off so the turn runs exactly N tokens. Time inside the engine's
  `Session.prefill` (which every decode step goes through) is measured and subtracted: what is
  left is the SDK's (sampling, incremental detokenisation, fence and marker detection, events).
  The embedded model's context is 1,024 tokens; the bench raises `engine.max_context` to fit the
  longest turn (timing only: text past 1,024 is outside what it was trained on).

Prints, per backend and length, the median over --repeats of SDK milliseconds per generated token
and its ratio to the 64-token turn, the named baseline (target: 2048 within 1.2x of 64). Before
incremental detokenisation the turn decoder re-decoded and rescanned the whole turn at every
token, so this ratio grew with N.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from freetoken_agents import Agent, FreeTokenModel, default_model, tool
from freetoken_agents.engine import Engine, Session
from freetoken_agents.testing import ScriptedModel

BASELINE = 64
TARGET = 1.2


@tool
def lookup(key: str) -> str:
    "Look a key up."
    return key


def scripted_answer(n: int) -> str:
    """n characters of prose with a fenced code block every few lines (anchors at each fence)."""
    block = "Here is a step.\n```python\nx = compute(1, 2)\n```\nAnd more text follows here. "
    return (block * (n // len(block) + 1))[:n]


class EngineClock:
    """Seconds spent inside `Session.prefill` (decode steps call it too) while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original: Callable[..., Any] | None = None

    def __enter__(self) -> EngineClock:
        original = self._original = Session.prefill
        clock = self

        def timed(session: Session, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(session, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - t0

        Session.prefill = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Session.prefill = self._original  # type: ignore[method-assign]


def run_scripted(n: int) -> tuple[float, float]:
    model = ScriptedModel([scripted_answer(n)], chunk=1)
    t0 = time.perf_counter()
    Agent(model, [lookup]).run("Explain, with code.")
    wall = time.perf_counter() - t0
    assert model.usage().decoded == n, (model.usage().decoded, n)
    return wall, 0.0


def run_embedded(model: FreeTokenModel, n: int) -> tuple[float, float]:
    tool_call = model.tokenizer.convert_tokens_to_ids("<tool_call>")
    bias = {t: -1e4 for t in (*model.stop_ids, tool_call)}
    agent = Agent(model, [lookup], max_new_tokens=n, model_settings={"logit_bias": bias})
    with EngineClock() as clock:
        t0 = time.perf_counter()
        result = agent.run("Write a long story about a river.")
        wall = time.perf_counter() - t0
    step = result.trace.steps[0]
    assert step.tokens_decoded >= n - 1, step.tokens_decoded  # the turn ran its full length
    return wall - clock.seconds, clock.seconds


def measure(name: str, run: Callable[[int], tuple[float, float]], lengths: list[int], repeats: int) -> dict:
    """Median SDK (and engine) seconds per generated token for each length; `run(n)` returns the
    SDK's and the engine's seconds for an n-token turn."""
    run(BASELINE)  # warm-up (imports, grammar and template caches)
    rows: dict[int, dict[str, float]] = {}
    for n in lengths:
        sdk, engine = zip(*(run(n) for _ in range(repeats)), strict=True)
        rows[n] = {
            "sdk_ms_per_token": statistics.median(sdk) / n * 1e3,
            "engine_ms_per_token": statistics.median(engine) / n * 1e3,
        }
    base = rows[BASELINE]["sdk_ms_per_token"]
    for n, row in rows.items():
        row["ratio_vs_64"] = row["sdk_ms_per_token"] / base
        engine = f" (engine {row['engine_ms_per_token']:.2f} ms/token)" if row["engine_ms_per_token"] else ""
        print(  # noqa: T201 - a bench prints its figures
            f"{name:9s} {n:5d} tokens: SDK {row['sdk_ms_per_token']:.4f} ms/token, "
            f"{row['ratio_vs_64']:.2f}x the {BASELINE}-token turn{engine}"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[BASELINE, 512, 2048])
    parser.add_argument("--repeats", type=int, default=3, help="runs per length (the median is kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the model is tiny)")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    lengths = sorted(set([BASELINE, *args.lengths]))
    torch.set_num_threads(args.threads)

    results = {"scripted": measure("scripted", run_scripted, lengths, args.repeats)}
    engine = Engine.from_pretrained(default_model())
    engine.max_context = max(engine.max_context, max(lengths) + 256)  # timing only, see the docstring
    model = FreeTokenModel(engine)
    results["embedded"] = measure("embedded", lambda n: run_embedded(model, n), lengths, args.repeats)
    longest = max(lengths)
    verdicts = {name: rows[longest]["ratio_vs_64"] <= TARGET for name, rows in results.items()}
    print(  # noqa: T201
        f"target: {longest} tokens within {TARGET}x of {BASELINE}: "
        + ", ".join(f"{name} {'met' if ok else 'MISSED'}" for name, ok in verdicts.items())
    )
    if args.json:
        print(json.dumps(results))  # noqa: T201


if __name__ == "__main__":
    main()
