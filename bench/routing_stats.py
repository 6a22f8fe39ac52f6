"""What real routing looks like: the embedded model's routing on its held-out evaluation questions,
recorded by the engine (`record_routing`), against uniform random routing of the same shape.

    python bench/routing_stats.py [--questions 24] [--tokens 48] [--seed 0] [--out trace.jsonl]

The embedded model (4 MoE layers, 8 experts, top-2) answers `--questions` held-out tool questions
(`recipes/tiny/world.py`), greedy, `--tokens` new tokens each, in one session per question. The
trace's decode tokens are summarised by `engine.simulate.stats.trace_stats` (temporal reuse,
next-layer same-index rate, top-10% share of (layer, expert) pairs, misses per token of a cache of
half the experts under LRU, decayed frequency and Belady), next to the same figures for uniform
random routing with the same tokens (the named baseline), measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import numpy as np

from freetoken_agents import default_model
from freetoken_agents.engine import Engine
from freetoken_agents.engine.memory.routing_trace import RoutingRecord, read_trace
from freetoken_agents.engine.simulate.stats import trace_stats
from freetoken_agents.recipes.tiny.world import SYSTEM_PROMPT, tool_question

FIGURES = (
    "reuse",
    "cross_layer",
    "top10_share",
    "misses_per_token_lru",
    "misses_per_token_frequency",
    "misses_per_token_belady",
)


def record(questions: int, tokens: int, seed: int, out: Path) -> list[RoutingRecord]:
    rng = random.Random(seed)
    with Engine.from_pretrained(default_model(), record_routing=out, progress=False) as engine:
        for _ in range(questions):
            q = tool_question(rng, "heldout")
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q.question}]
            ids = engine.apply_chat_template(messages)
            engine.generate(ids, max_new_tokens=tokens, stop_token_ids=())
    return list(read_trace(out))


def uniform_like(records: list[RoutingRecord], num_experts: int, seed: int) -> list[RoutingRecord]:
    """The same (seq, token, layer, phase) rows with experts drawn uniformly at random."""
    rng = np.random.default_rng(seed)
    return [
        RoutingRecord(
            r.seq,
            r.token,
            r.layer,
            tuple(int(e) for e in rng.choice(num_experts, size=len(r.experts), replace=False)),
            r.weights,
            r.phase,
        )
        for r in records
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="keep the trace here (default: a temp file)")
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="freetoken-routing-")) / "trace.jsonl"
    records = record(args.questions, args.tokens, args.seed, out)
    num_experts = 1 + max(e for r in records for e in r.experts)
    real = trace_stats(records, num_experts=num_experts).to_dict()
    random_ = trace_stats(uniform_like(records, num_experts, args.seed), num_experts=num_experts).to_dict()
    decode = sum(r.phase == "decode" for r in records)
    print(f"trace: {len(records)} records ({decode} decode), {args.questions} sequences -> {out}")
    print(f"{'figure':27s} {'embedded':>10s} {'random':>10s} {'ratio':>7s}")
    for name in FIGURES:
        a, b = real.get(name), random_.get(name)
        if a is None or b is None:
            continue
        ratio = a / b if b else float("nan")
        print(f"{name:27s} {a:10.3f} {b:10.3f} {ratio:7.2f}")
    if args.json:
        print(json.dumps({"embedded": real, "random": random_}, indent=1))


if __name__ == "__main__":
    main()
