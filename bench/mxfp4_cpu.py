"""MXFP4 projections on the CPU: the engine's block decode against decoding the whole weight.

    python bench/mxfp4_cpu.py            # ~1 min on 2 cores
    python bench/mxfp4_cpu.py --quick    # two shapes, fewer repeats
    python bench/mxfp4_cpu.py --json

Contenders, on the same random MXFP4 weights ([N, K/2] E2M1 bytes, [N, K/32] E8M0 scales) and
activations, in inference mode on torch's threads:
  (a) block   `mxfp4.mxfp4_linear` on the CPU (`cpu_linear`): `DECODE_BLOCK` weights decoded at a
              time into a per-thread scratch by one gather per stored byte, ``F.linear`` per block.
  (b) whole   what the CPU path did before: ``F.linear(x, decode_weight(...))``, the codec's decode
              of the whole weight, then one product.
Both multiply the same decoded values; the outputs are checked to agree to fp32 rounding (a
block's product may sum in another order than the whole weight's; the largest difference relative
to the output's largest value is printed). Shapes are expert
projections: Mixtral-8x7B's gate/up [14336, 4096] and down [4096, 14336], Qwen3-30B-A3B's gate/up
[768, 2048], gpt-oss's [5760, 2880]. Weights cycle over 4 copies (MXFP4 bytes beyond the caches
for the big shapes). Prints, per shape and token count T, the median ms and the stored GB/s of
each contender and the ratio whole / block (> 1: the block decode is faster).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = {
    "mixtral gate/up": (14336, 4096),
    "mixtral down": (4096, 14336),
    "qwen3-30b gate/up": (768, 2048),
    "gpt-oss gate/up": (5760, 2880),
}


def run_shape(n: int, k: int, tokens: int, reps: int) -> dict[str, Any]:
    from freetoken_agents.engine.kernels.mxfp4 import decode_weight, mxfp4_linear
    from freetoken_agents.engine.simulate.measure import median_seconds

    g = torch.Generator().manual_seed(0)
    weights = [
        (
            torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
            torch.randint(118, 131, (n, k // 32), dtype=torch.uint8, generator=g),
        )
        for _ in range(4)
    ]
    x = torch.randn(tokens, k, generator=g)
    stored = weights[0][0].nbytes + weights[0][1].nbytes
    turn = [0]

    def contender(linear: Any) -> Any:
        def step() -> None:
            blocks, scales = weights[turn[0] % len(weights)]
            turn[0] += 1
            linear(x, blocks, scales)

        return step

    def whole(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return F.linear(x, decode_weight(blocks, scales, x.dtype))

    with torch.inference_mode():
        got, want = mxfp4_linear(x, *weights[0]), whole(x, *weights[0])
        rel = float((got - want).abs().max() / want.abs().max())
        block_ms = median_seconds(contender(mxfp4_linear), reps) * 1e3
        whole_ms = median_seconds(contender(whole), reps) * 1e3
    return {
        "n": n,
        "k": k,
        "tokens": tokens,
        "block_ms": block_ms,
        "whole_ms": whole_ms,
        "block_gbps": stored / block_ms / 1e6,
        "whole_gbps": stored / whole_ms / 1e6,
        "whole_over_block": whole_ms / block_ms,
        "max_rel_diff": rel,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two shapes, 3 repeats")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", default="1,16", help="token counts, comma-separated (default 1,16)")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args()
    shapes = dict(list(SHAPES.items())[2:]) if args.quick else SHAPES
    reps = 3 if args.quick else args.reps
    rows = []
    for name, (n, k) in shapes.items():
        for t in (int(v) for v in args.tokens.split(",")):
            rows.append({"shape": name, **run_shape(n, k, t, reps)})
    if args.json:
        json.dump({"threads": torch.get_num_threads(), "rows": rows}, sys.stdout, indent=2)
        print()
        return 0
    print(f"MXFP4 on the CPU, {torch.get_num_threads()} threads: median ms (stored GB/s)")
    print(f"{'shape':20} {'N x K':>12} {'T':>3} {'block':>16} {'whole':>16} {'whole/block':>12} max rel diff")
    for r in rows:
        print(
            f"{r['shape']:20} {r['n']:>5} x {r['k']:<5} {r['tokens']:>3} "
            f"{r['block_ms']:8.2f} ({r['block_gbps']:4.2f}) {r['whole_ms']:8.2f} ({r['whole_gbps']:4.2f}) "
            f"{r['whole_over_block']:11.2f}x {r['max_rel_diff']:.1e}"
        )
    return 0 if all(r["max_rel_diff"] < 1e-5 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
