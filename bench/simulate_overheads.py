"""What the tiered provider's Python costs q* on a GPU machine: the simulated table's rows with its
fixed costs priced in.

    python bench/simulate_overheads.py [--hardware rtx4090-pcie4] [--fast 0.25,0.5]   # ~4 min, 2 cores

`tier_overhead_us` (per MoE layer of a tiered step: bookkeeping and pre-gating), `miss_overhead_us`
(per routed expert outside tier 1: q*'s decision and the Python around computing it where its
weights are) and `stream_overhead_us` (what a STREAM's tier moves add) are what the engine's own
policies pay and llama.cpp's static split, written in C++, does not. The built-in profiles price
them at what this bench measured (`engine/simulate/engine_costs.py`: `MEASURED`, with the command
and date; re-measure here and update it when the provider's hot path changes). This measures the three
costs, and the all-hit layer's (a decode layer whose routed experts are all in tier 1, beyond the
resident engine's layer: `simulate.all_hit.all_hit_overhead_us`; printed, not simulated, as the
profiles have no field for it), on this machine on each model's own MoE layer shape, its experts
per layer and top-k (`simulate.measure._tiered_overheads_us`, what `--profile-here --model M`
writes; the median of `--measures` runs), then replays the README's calibrated traces (Mixtral-8x7B, 577
tokens; Qwen3-30B-A3B, 300 tokens; MXFP4 experts; seed 0) on `--hardware` with the costs at each
of `--scales` times the measured ones, and prints q* (cold, and started from the static split's
profiling pass) against the static split. Everything but the measured costs is simulated: the
figures are predictions, not measurements of a GPU. A CPU of a GPU box runs this Python faster
than a small cloud VM: scale 1 is this machine, the smaller scales what a faster core would give.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch


def main() -> None:
    from freetoken_agents.engine.simulate import shapes
    from freetoken_agents.engine.simulate.all_hit import all_hit_overhead_us
    from freetoken_agents.engine.simulate.measure import _tiered_overheads_us
    from freetoken_agents.engine.simulate.profiles import load_profile
    from freetoken_agents.engine.simulate.simulator import simulate
    from freetoken_agents.engine.simulate.synthetic import MIXTRAL_8X7B, QWEN3_30B_A3B, preset_trace

    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--hardware", default="rtx4090-pcie4")
    parser.add_argument("--fast", default="0.25,0.5", help="fast budgets, fractions of the expert bytes")
    parser.add_argument("--scales", default="0,0.25,0.5,1", help="multiples of the measured costs")
    parser.add_argument("--measures", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads while measuring")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    base = load_profile(args.hardware)
    models = {
        "mixtral-8x7b": preset_trace(MIXTRAL_8X7B, tokens=577, seed=0),
        "qwen3-30b-a3b": preset_trace(QWEN3_30B_A3B, tokens=300, seed=0),
    }
    # model -> (us per tiered layer, us per miss, us more per STREAM)
    costs: dict[str, tuple[float, float, float]] = {}
    for name in models:
        shape = shapes.shape_for(name)
        runs = [
            _tiered_overheads_us(400, None, experts=shape.num_experts, top_k=shape.top_k)
            for _ in range(args.measures)
        ]
        tier_us, miss_us, stream_us = (statistics.median(r[i] for r in runs) for i in range(3))
        costs[name] = (tier_us, miss_us, stream_us)
        hits = [
            all_hit_overhead_us(400, None, experts=shape.num_experts, top_k=shape.top_k)
            for _ in range(args.measures)
        ]
        hit_us, resident_us = (statistics.median(r[i] for r in hits) for i in range(2))
        print(
            f"measured here on {name}'s MoE layer ({shape.num_experts} experts, top-{shape.top_k}; "
            f"{args.threads} threads, median of {args.measures}): "
            f"{tier_us:.1f} us per tiered MoE layer, {miss_us:.1f} us per miss, "
            f"{stream_us:.1f} more a STREAM; {hit_us:.1f} us per all-hit layer "
            f"beyond the resident layer's {resident_us:.1f}"
        )
    scales = [float(s) for s in args.scales.split(",")]
    print(f"\nSIMULATED decode tok/s on {args.hardware}, MXFP4 experts")
    print(
        "| model | fast | scale | tier us/layer | us/miss | us/STREAM more | q* | q* profiled | static "
        "| q*/static | q* profiled/static |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    for name, trace in models.items():
        shape = shapes.shape_for(name)
        tier_us, miss_us, stream_us = costs[name]
        for fast in (float(f) for f in args.fast.split(",")):
            fast_bytes = int(fast * shape.total_expert_bytes("mxfp4"))
            static = None
            for scale in scales:
                profile = dataclasses.replace(
                    base,
                    tier_overhead_us=scale * tier_us,
                    miss_overhead_us=scale * miss_us,
                    stream_overhead_us=scale * stream_us,
                )
                policies = ["qstar", "qstar-profiled"] + (["static"] if static is None else [])
                report = simulate(
                    trace, shape, profile, fast_bytes=fast_bytes, codec="mxfp4", policies=policies
                )
                static = static if static is not None else report.result("static").tokens_per_s
                cold = report.result("qstar").tokens_per_s
                warm = report.result("qstar-profiled").tokens_per_s
                print(
                    f"| {name} | {fast:.0%} | {scale:g} | {scale * tier_us:.1f} | {scale * miss_us:.1f} | "
                    f"{scale * stream_us:.1f} | "
                    f"{cold:.1f} | {warm:.1f} | {static:.1f} | {cold / static:.2f}x | {warm / static:.2f}x |",
                    flush=True,
                )
    print(f"\n({time.perf_counter() - t0:.0f} s of replays)")


if __name__ == "__main__":
    main()
