"""Prefilled tokens and wall time of an Agent over HTTP with the server's prefix reuse vs
`--no-prefix-cache`, at ~2,000 tokens of context (one command: `python bench/serve_agent.py`).

The agent runs on `OpenAICompatibleModel` against `freetoken serve` (a real server process, one
at a time). Its system prompt is ~2,000 tokens; every turn must call one of three tools (the
last turn answers), and each call fails with probability 0.3 (a ValueError: the agent rolls back
to the anchor before the call, adds a failure note and asks again). Every request re-sends the
whole conversation. With reuse the server prefills only what is new; without, everything.
"Prefilled" is what the server reports (prompt tokens minus `cached_tokens`), summed over a run.

The model is a small random qwen3_moe (hidden 256, 4 layers, 8 experts, 8k context) built on
the fly, the failures follow `--seed`, decoding is greedy: both modes make the same calls and
the same requests. Reported: medians over `--runs` runs per mode; target: >= 5x fewer prefilled.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import build_tiny_model  # noqa: E402

from freetoken_agents import Agent, OpenAICompatibleModel, RetryPolicy, tool  # noqa: E402
from freetoken_agents.engine import Engine  # noqa: E402

FILLER = (
    "Orders ship from the warehouse nearest the customer. A parcel over twenty kilograms goes by "
    "freight, anything lighter by post; refunds are issued to the original payment method. "
)


def system_prompt(model_dir: Path, target_tokens: int) -> str:
    engine = Engine.from_pretrained(model_dir)
    text = "You are a support agent. Policies:\n"
    while len(engine.encode(text)) < target_tokens:
        text += FILLER
    engine.close()
    return text


def make_tools(rng: random.Random, failure_rate: float) -> list:
    """Three tools, each call failing with probability `failure_rate` (drawn from `rng`)."""

    def maybe_fail(what: str) -> None:
        if rng.random() < failure_rate:
            raise ValueError(f"{what}: the backend rejected the request")

    @tool
    def lookup_order(order_id: int) -> dict:
        """Status of an order."""
        maybe_fail("lookup_order")
        return {"order_id": order_id, "status": "shipped"}

    @tool
    def refund(order_id: int, amount: int) -> dict:
        """Refund part of an order."""
        maybe_fail("refund")
        return {"order_id": order_id, "refunded": amount}

    @tool
    def shipping_cost(weight_kg: int) -> dict:
        """Cost to ship a parcel."""
        maybe_fail("shipping_cost")
        return {"weight_kg": weight_kg, "cost": 4 + weight_kg}

    return [lookup_order, refund, shipping_cost]


@contextlib.contextmanager
def server(model_dir: Path, *, reuse: bool, threads: int) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "freetoken_agents.cli", "--threads", str(threads), "serve"]
    cmd += [
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--log-level",
        "warning",
    ]
    if not reuse:
        cmd.append("--no-prefix-cache")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited: {proc.stderr.read() if proc.stderr else ''}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/models", timeout=5).status_code == 200:
                    break
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run_agent(base: str, prompt: str, args: argparse.Namespace, seed: int) -> dict:
    tools = make_tools(random.Random(seed), args.failure_rate)
    model = OpenAICompatibleModel(base, "bench")
    agent = Agent(
        model,
        tools,
        system_prompt=prompt,
        tool_choice=lambda step: "required" if step <= args.steps else "none",
        retry=RetryPolicy(model_attempts=8),
        max_steps=args.steps + 1,
        max_new_tokens=8,
        model_settings={"max_call_tokens": 16},
    )
    t0 = time.perf_counter()
    result = agent.run("Order 1042 arrived damaged; sort it out.")
    seconds = time.perf_counter() - t0
    usage = model.usage()
    calls = len(result.trace.tool_calls) + len(result.trace.rollbacks)
    return {
        "seconds": seconds,
        "prefilled": usage.prefilled,
        "cached": usage.reused,
        "calls": calls,
        "rollbacks": len(result.trace.rollbacks),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000, help="system prompt length in tokens")
    ap.add_argument("--steps", type=int, default=6, help="turns that must call a tool")
    ap.add_argument("--failure-rate", type=float, default=0.3)
    ap.add_argument("--runs", type=int, default=3, help="agent runs per mode (medians reported)")
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="freetoken-serve-bench-"))
    build_tiny_model(
        "qwen3_moe",
        folder,
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=512,
        moe_intermediate_size=128,
        max_position_embeddings=8192,
    )
    prompt = system_prompt(folder, args.tokens)
    results: dict[str, list[dict]] = {}
    for mode, reuse in (("reuse", True), ("no-prefix-cache", False)):
        with server(folder, reuse=reuse, threads=args.threads) as base:
            run_agent(base, prompt, args, seed=10_000)  # warm-up (not counted)
            results[mode] = [run_agent(base, prompt, args, seed=args.seed + i) for i in range(args.runs)]
    on, off = results["reuse"], results["no-prefix-cache"]
    assert [r["calls"] for r in on] == [r["calls"] for r in off], "the two modes made different calls"

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(
        f"context: system prompt of ~{args.tokens} tokens; {args.steps} tool turns;"
        f" failure rate {args.failure_rate}"
    )
    print(f"per run: tool calls {[r['calls'] for r in on]}, rollbacks {[r['rollbacks'] for r in on]}")
    for name, rows in (("reuse          ", on), ("no-prefix-cache", off)):
        print(
            f"{name}: median prefilled {med(rows, 'prefilled'):8.0f} tokens,"
            f" cached {med(rows, 'cached'):8.0f}, wall {med(rows, 'seconds'):6.2f} s"
            f"   (runs: {[r['prefilled'] for r in rows]})"
        )
    ratio = med(off, "prefilled") / max(1.0, med(on, "prefilled"))
    print(f"prefilled tokens: {ratio:.1f}x fewer with reuse (target >= 5x)")
    print(f"wall time: {med(off, 'seconds') / med(on, 'seconds'):.1f}x faster with reuse")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
