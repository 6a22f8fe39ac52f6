"""Which experts should leave RAM? Disk reads per decode token of eviction orders, replayed over
the routing of bench/offload.py's model.

    python bench/eviction.py [--tokens 64] [--prompts 4] [--ram 0.5]     # ~2 min on 2 cores

Records the greedy routing of the Mixtral-shaped offload model (the same weights: same seed) for a
few random prompts, then replays it through one RAM tier holding `--ram` of the experts (the two
exclusive RAM tiers of bench/offload.py together) with the real `HostTier` and three eviction
orders: least recently used; least used by decayed routing frequency (`RoutingFrequency`, what q*
evicts by); and Belady's (the expert used again farthest in the future: the offline optimum no
online order can beat). A decode token routes to top_k x layers experts; every one not in RAM is
one block read from disk. Prefetch is left out: it moves reads earlier, not fewer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # bench/_offload_tools.py: the model, its routing


def replay(trace: list[list[tuple[int, list[int]]]], capacity: int, order: str, decay: float = 0.9) -> float:
    """Blocks read from disk per decode token with RAM for `capacity` experts, evicting by
    `order` ("lru", "frequency" or "belady"). The prefill's reads are not counted."""
    from freetoken_agents.engine.memory import HostTier
    from freetoken_agents.engine.memory.routing import RoutingFrequency

    uses = [(t, layer, e) for t, fwd in enumerate(trace) for layer, used in fwd for e in used]
    next_use: list[float] = [float("inf")] * len(uses)
    seen: dict[tuple[int, int], int] = {}
    for i in range(len(uses) - 1, -1, -1):
        key = uses[i][1:]
        next_use[i] = seen.get(key, float("inf"))
        seen[key] = i
    upcoming: dict[tuple[int, int], float] = {}
    routing = RoutingFrequency(sorted({u[1] for u in uses}), decay)
    ram = HostTier[bool](capacity)
    if order == "frequency":
        ram.rank = routing.of  # type: ignore[assignment]
    elif order == "belady":
        ram.rank = lambda k: -upcoming.get(k, float("inf"))  # type: ignore[assignment,arg-type]
    reads, i = 0, 0
    for t, fwd in enumerate(trace):
        for layer, used in fwd:
            routing.note(layer, used)
            for e in used:
                upcoming[(layer, e)] = next_use[i]
                i += 1
                if ram.get((layer, e)) is None:
                    reads += t > 0
                    ram.put((layer, e), True, 1)
    return reads / (len(trace) - 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--prompts", type=int, default=4, help="random 16-token prompts (seeds 1..N)")
    ap.add_argument("--ram", type=float, default=0.5, help="fraction of the experts RAM holds")
    args = ap.parse_args()
    from _offload_tools import build_model, record_routing

    from freetoken_agents.engine import Engine

    torch.set_num_threads(1)
    orders = ("lru", "frequency", "belady")
    with tempfile.TemporaryDirectory(prefix="ft-eviction-") as tmp:
        shape = build_model(Path(tmp), quick=False)
        engine = Engine.from_pretrained(tmp)
        block_mb = engine.experts.nbytes / (shape["layers"] * shape["experts"]) / 1e6
        capacity = int(args.ram * shape["layers"] * shape["experts"])
        rows: dict[str, list[float]] = {o: [] for o in orders}
        for seed in range(1, args.prompts + 1):
            gen = torch.Generator().manual_seed(seed)
            prompt = torch.randint(0, shape["vocab"], (16,), generator=gen).tolist()
            trace = record_routing(engine, prompt, args.tokens)
            for o in orders:
                rows[o].append(replay(trace, capacity, o))
    touched = shape["top_k"] * shape["layers"]
    print(
        f"RAM for {capacity} of {shape['layers'] * shape['experts']} experts; a decode token routes to "
        f"{touched}; {args.prompts} prompts x {args.tokens} tokens; blocks of {block_mb:.1f} MB"
    )
    lru = statistics.median(rows["lru"])
    for o in orders:
        med = statistics.median(rows[o])
        print(
            f"  {o:9s} blocks read per decode token: median {med:.2f} ({med * block_mb:.0f} MB), "
            f"per prompt {[round(x, 2) for x in rows[o]]}, {med / lru:.2f}x LRU"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
