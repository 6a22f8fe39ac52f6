"""Agent-step latency of ChatFreeToken with prefix reuse vs reuse disabled, at ~2,000 tokens of
history (one command: `python bench/langchain_reuse.py`).

A LangChain agent re-sends its whole history every step. With reuse the adapter restores the
cached prefix and prefills only the new messages; without it every step prefills everything.
The model is a small random qwen3_moe (hidden 256, 4 layers, 8 experts) built on the fly; the
step is one `invoke` with `max_tokens` new tokens (default 1: the prompt-processing latency an
agent waits for before the first token).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import build_tiny_model  # noqa: E402

from freetoken_agents.integrations.langchain import ChatFreeToken  # noqa: E402

FILLER = "The weather in Paris is sunny today, with a high of 21 degrees and a light wind. "


def history(target_tokens: int, llm: ChatFreeToken) -> list[BaseMessage]:
    """System + user + rounds of (tool call, tool result) until about `target_tokens`."""
    msgs: list[BaseMessage] = [SystemMessage("You are a helpful assistant."), HumanMessage("Plan a trip.")]
    backend = llm._handle().backend
    i = 0
    while len(backend.render(_dicts(msgs), None)) < target_tokens:
        call = {"name": "lookup", "args": {"city": f"city{i}"}, "id": f"c{i}", "type": "tool_call"}
        msgs += [AIMessage("", tool_calls=[call]), ToolMessage(FILLER, tool_call_id=f"c{i}")]
        i += 1
    return msgs


def _dicts(msgs: list[BaseMessage]) -> list[dict]:
    from freetoken_agents.integrations.langchain.messages import to_chat_dicts

    return to_chat_dicts(msgs)


def step_latencies(llm: ChatFreeToken, msgs: list[BaseMessage], steps: int) -> tuple[list[float], list[int]]:
    """Time `steps` agent steps: step k sends the history up to its k-th new (call, result) pair."""
    base = len(msgs) - 2 * steps
    llm.invoke(msgs[:base])  # the step before: what a running agent has already sent
    times, reads = [], []
    for k in range(steps):
        prompt = msgs[: base + 2 * (k + 1)]
        t0 = time.perf_counter()
        out = llm.invoke(prompt)
        times.append(time.perf_counter() - t0)
        reads.append(out.usage_metadata["input_token_details"]["cache_read"])
    return times, reads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000, help="history length in tokens")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared CPU)")
    ap.add_argument("--max-tokens", type=int, default=1, help="new tokens per step")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="freetoken-lc-bench-"))
    build_tiny_model(
        "qwen3_moe",
        folder,
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=512,
        moe_intermediate_size=128,
        max_position_embeddings=8192,
    )
    opts = dict(model=str(folder), max_tokens=args.max_tokens)
    reuse = ChatFreeToken(**opts, prefix_cache=True)
    msgs = history(args.tokens, reuse)
    n = len(reuse._handle().backend.render(_dicts(msgs), None))
    reuse.invoke([HumanMessage("warm up")])
    with_reuse, reads = step_latencies(reuse, msgs, args.steps)
    without, _ = step_latencies(ChatFreeToken(**opts, prefix_cache=False), msgs, args.steps)
    a, b = statistics.median(with_reuse), statistics.median(without)
    print(f"history: {n} tokens, {len(msgs)} messages; {args.max_tokens} new token(s) per step")
    print(
        f"reuse on : median step {a * 1e3:8.1f} ms  {[round(t * 1e3, 1) for t in with_reuse]}"
        f"  cache_read {reads}"
    )
    print(f"reuse off: median step {b * 1e3:8.1f} ms  {[round(t * 1e3, 1) for t in without]}")
    print(f"speed-up : {b / a:.1f}x")


if __name__ == "__main__":
    main()
