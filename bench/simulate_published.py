"""The simulator held to published decode runs of real MoE offloading systems (issue 62).

    python bench/simulate_published.py [--tokens 128] [--seeds 0,1,2]   # ~1 min on 2 cores

Each setup of `engine/simulate/published.py` (its source, machine profile with every figure's
source or "estimate", model, codec, fast-memory share and the policy that system runs: one of
`simulate`'s, or the system's own cache from `engine/simulate/peers.py`) is replayed on synthetic
traces of its model; the median prediction over the seeds is printed beside the published tok/s,
with their ratio (target: within 1.25x; for a published "> x", between x and 1.5x). Issue 62's
five setups and a sixth, on another card, that checks the NVIDIA per-layer cost away from the run
it was set from. Everything printed is simulated, not measured.
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    from freetoken_agents.engine.simulate.published import PUBLISHED_RUNS, predict

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens per synthetic trace")
    parser.add_argument("--seeds", default="0,1,2", help="trace seeds (the median is printed)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"{'setup':<70} {'policy':<18} {'published':>10} {'simulated':>10} {'ratio':>6}")
    within = 0
    for run in PUBLISHED_RUNS:
        sim = statistics.median(predict(run, args.tokens, seed) for seed in seeds)
        ratio = sim / run.published
        ok = run.published <= sim <= 1.5 * run.published if run.at_least else 1 / 1.25 <= ratio <= 1.25
        within += ok
        shown = (">" if run.at_least else "") + f"{run.published:g}"
        print(
            f"{run.name:<70} {run.policy:<18} {shown:>10} {sim:>10.2f} {ratio:>5.2f}x {'ok' if ok else 'OFF'}"
        )
        print(f"    source: {run.source}; machine: {run.profile}")
    print(f"{within} of {len(PUBLISHED_RUNS)} within the target (simulated, not measured)")


if __name__ == "__main__":
    main()
