"""Validation against reality (issue 33): the simulator's predicted decode tok/s of a routing trace
recorded by a REAL tiered run on this machine, replayed with this machine's measured profile,
against the tok/s that run measured.

    python bench/simulate_validate.py                 # fp32 and int8, a few minutes on 2 cores
    python bench/simulate_validate.py --tokens 48 --reps 3 --formats fp32 --json

Model: the random Mixtral-shaped checkpoint of bench/tiered_decode.py (its `build_model`: hidden
512, intermediate 1024, 7 layers, 8 experts, top-2, vocab 8192, unit-std embeddings), converted to
FTW with `quant="fp32"` (and "int8").

Per file and per config:
  resident          `Engine.from_pretrained(ftw)` (every expert in RAM); predicted by replaying its
                    trace under "qstar" with tier 1 holding every expert (F=1: no misses), i.e.
                    the machine model's compute alone.
  qstar f=F         placement "qstar", TieringOptions(), MemoryBudget as bench/tiered_decode.py:
                    fast = F x X + K, host = S + 16 MiB (X: experts' tier-1 bytes, S: stored bytes,
                    K: room for the KV cache prompt + --tokens positions need); predicted with
                    policy "qstar".
  stream f=F        the live "stream" placement (per-layer LRU, always stream), same budget;
                    predicted with policy "layer-lru".
Every engine records its routing (`record_routing=PATH`), is warmed up (--warmup untimed greedy
runs), then the configs are timed in rotated order, --reps times (bench/_offload_tools
`time_engine`: prefill of --prompt tokens, then --tokens - 1 greedy decode steps); the measured
rate is the median decode tok/s. The trace file holds every sequence the engine ran (warm-ups and
timed runs); it is replayed whole by `simulate(records, shape_from_spec(engine.spec), profile,
fast_bytes=F x X, host_bytes=None, codec=...)` (the simulator's tier 1 holds experts only: no KV)
on `measure_profile()` of this machine. Ratio = predicted / measured; target: within 25%.

Diagnosis (resident engine of each file): the expert part of a decode token is timed by wrapping
the expert store (`run` per MoE layer: the routed experts and their combine), the rest (attention,
norms, router, lm_head, the Python around them) is the token's time minus that; and one MoE layer's
`run` on one token is timed with two distinct experts and with one expert alone, which splits it into
a per-expert and a per-call cost. Each is printed beside what the machine model charges for it
(expert: max(bytes / memory bandwidth, flops / CPU flops) + expert_overhead_us; dense per layer:
max(dense bytes at fp32 / memory bandwidth, flops / CPU flops) + layer_overhead_us x layers / MoE
layers), so the missing terms read off as measured seconds. The profile's memory bandwidth is read
with one-token matmuls of the simulated model's row length (`--profile-k`, default its --hidden):
on this machine a K=512 row reads at about half the rate of a K=4096 one, and a profile of the
machine for one model measures the shapes that model runs (`measure_profile(matmul_k=...)`).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _offload_tools import Evictor, time_engine  # noqa: E402
from tiered_decode import PHASES, add_model_arguments, build_model, tier_sizes, tiered_probes  # noqa: E402

TARGET = 0.25
PLACEMENTS = {"qstar": "qstar", "stream": "layer-lru"}  # live placement -> simulated policy


class TimedStore:
    """An expert-store wrapper timing each `run` (one MoE layer's experts); built lazily so the
    engine import stays inside functions."""

    def __new__(cls, inner: Any) -> Any:
        from freetoken_agents.engine.model.experts import DelegatingStore

        class _Timed(DelegatingStore):
            def __init__(self, inner: Any) -> None:
                super().__init__(inner)
                self.seconds, self.calls = 0.0, 0
                self.last: Any = None

            def run(self, layer: int, hidden: Any, ids: Any, w: Any, spec: Any) -> Any:
                t0 = time.perf_counter()
                out = self.inner.run(layer, hidden, ids, w, spec)
                self.seconds += time.perf_counter() - t0
                self.calls += 1
                self.last = (layer, hidden, ids, w, spec)
                return out

        return _Timed(inner)


def diagnose(
    engine: Any, prompt: list[int], args: argparse.Namespace, costs: Any, shape: Any
) -> dict[str, Any]:
    """Measured split of the resident engine's decode token vs the machine model's (docstring)."""
    from freetoken_agents.engine.simulate.measure import median_seconds

    inner = engine.experts
    timed = TimedStore(inner)
    engine.use_expert_provider(timed)
    try:
        runs = []
        for _ in range(3):
            timed.seconds, timed.calls = 0.0, 0
            with engine.new_session() as s:
                tok = int(s.prefill(prompt, last_only=True)[0].argmax())
                timed.seconds, timed.calls = 0.0, 0
                t0 = time.perf_counter()
                for _ in range(args.tokens - 1):
                    tok = int(s.prefill([tok], last_only=True)[0].argmax())
                total = time.perf_counter() - t0
            n = args.tokens - 1
            runs.append((total / n, timed.seconds / n, timed.calls / n))
        token_s = statistics.median(r[0] for r in runs)
        experts_s = statistics.median(r[1] for r in runs)
        calls = statistics.median(r[2] for r in runs)
        _, hidden, ids, w, spec = timed.last
        h1 = hidden[-1:].clone()
        w2, w1 = torch.full((1, 2), 0.5, dtype=w.dtype), torch.ones((1, 1), dtype=w.dtype)
        # every layer's experts in turn (cold in cache, as in decode): pairs (e, e+1) vs (e) alone
        layers, n_exp = list(shape.moe_layers), shape.num_experts
        pairs = [(lay, e) for lay in layers for e in range(0, n_exp - 1, 2)]
        two = [torch.tensor([[e, e + 1]], dtype=ids.dtype) for _, e in pairs]
        one = [torch.tensor([[e]], dtype=ids.dtype) for _, e in pairs]

        def sweep(sel: list[Any], wt: Any) -> None:
            for (lay, _), i in zip(pairs, sel, strict=True):
                inner.run(lay, h1, i, wt, spec)

        with torch.no_grad():
            t_two = median_seconds(lambda: sweep(two, w2), 9) / len(pairs)
            t_same = median_seconds(lambda: sweep(one, w1), 9) / len(pairs)
    finally:
        engine.use_expert_provider(inner)
    n_moe = len(shape.moe_layers)
    per_expert = t_two - t_same
    per_call = t_same - per_expert
    rest_s = token_s - experts_s
    model_expert = costs.fast_compute_s(1)
    model_dense_layer = costs.dense_s(1)
    return {
        "token_ms": 1e3 * token_s,
        "experts_ms_per_token": 1e3 * experts_s,
        "moe_calls_per_token": calls,
        "rest_ms_per_token": 1e3 * rest_s,
        "moe_call_top2_ms": 1e3 * t_two,
        "moe_call_one_expert_ms": 1e3 * t_same,
        "measured_per_expert_ms": 1e3 * per_expert,
        "measured_per_moe_call_fixed_ms": 1e3 * per_call,
        "measured_rest_per_layer_ms": 1e3 * rest_s / n_moe,
        "model_per_expert_ms": 1e3 * model_expert,
        "model_dense_per_layer_ms": 1e3 * model_dense_layer,
        # the dense weights' bytes at fp32 (the CPU engine's dtype, as the model now prices them)
        "dense_per_layer_at_fp32_bytes_ms": 1e3
        * shape.dense_bytes_per_token("fp32")
        / n_moe
        / costs.device_bps,
        "model_token_ms": 1e3 * n_moe * (model_dense_layer + shape.top_k * model_expert),
        "expert_bytes_model": costs.fast_bytes,
        "dense_bytes_per_token_bf16": shape.dense_bytes_per_token("bf16"),
        "dense_bytes_per_token_fp32": shape.dense_bytes_per_token("fp32"),
    }


def run_format(quant: str, folder: Path, tmp: Path, args: argparse.Namespace, profile: Any) -> dict[str, Any]:
    from freetoken_agents.engine import Engine, TieringOptions
    from freetoken_agents.engine.loading.convert import convert_checkpoint
    from freetoken_agents.engine.memory import MemoryBudget
    from freetoken_agents.engine.memory.routing_trace import read_trace
    from freetoken_agents.engine.simulate.machine import ExpertCosts
    from freetoken_agents.engine.simulate.shapes import shape_from_spec
    from freetoken_agents.engine.simulate.simulator import simulate

    ftw = tmp / f"{quant}.ftw"
    convert_checkpoint(folder, ftw, quant=quant, progress=False)
    x_bytes, s_bytes = tier_sizes(ftw)
    traces: dict[str, Path] = {}
    engines: dict[str, Any] = {}
    traces["resident"] = tmp / f"{quant}-resident.jsonl"
    engines["resident"] = Engine.from_pretrained(ftw, record_routing=traces["resident"])
    pool = engines["resident"].kv_pool
    kv_room = (math.ceil((args.prompt + args.tokens) / pool.block_size) + 2) * pool.bytes_per_block
    fractions: dict[str, float] = {"resident": 1.0}
    for placement in PLACEMENTS:
        for f in args.fractions:
            name = f"{placement} f={f:g}"
            budget = MemoryBudget(fast_bytes=int(f * x_bytes) + kv_room, host_bytes=s_bytes + (16 << 20))
            traces[name] = tmp / f"{quant}-{placement}-{f:g}.jsonl"
            fractions[name] = f
            engines[name] = Engine.from_pretrained(
                ftw,
                placement=placement,
                memory=budget,
                tiering=TieringOptions(),
                record_routing=traces[name],
            )
    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    for eng in engines.values():
        for _ in range(args.warmup):
            time_engine(eng, prompt, args.tokens, Evictor([]))
    names = list(engines)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            gc.collect()
            eng = engines[name]
            # the tiered provider under the routing recorder
            probes = None if name == "resident" else tiered_probes(SimpleNamespace(experts=eng.experts.inner))
            runs[name].append(time_engine(eng, prompt, args.tokens, Evictor([]), probes))
    spec = engines["resident"].spec
    shape = shape_from_spec(spec)
    codec = quant
    costs = ExpertCosts.of(shape, profile, codec)
    for eng in engines.values():
        eng.close()  # writes the traces out
    diag = diagnose(Engine.from_pretrained(ftw), prompt, args, costs, shape)
    sim_x = len(shape.moe_layers) * shape.num_experts * costs.fast_bytes  # the model's X
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        records = list(read_trace(traces[name]))
        policy = "qstar" if name == "resident" else PLACEMENTS[name.split()[0]]
        # F x X of the live engine; resident: room for every expert as the model sizes them
        fast = 2 * sim_x if name == "resident" else int(fractions[name] * x_bytes)
        report = simulate(
            records, shape, profile, fast_bytes=fast, host_bytes=None, codec=codec, policies=[policy]
        )
        res = report.result(policy)
        rs = runs[name]
        measured = statistics.median(r["tok_s"] for r in rs)
        live = {}
        if name != "resident":
            keys = ["stream", "host", "storage_reads"] + [f"phase[{p}]" for p in PHASES]
            live = {key: statistics.median(r[f"{key}_per_token"] for r in rs) for key in keys}
            live["moved_host_fast_bytes"] = statistics.median(r["moved[host->fast]_per_token"] for r in rs)
        rows[name] = {
            "measured_tok_s": measured,
            "measured_runs": [r["tok_s"] for r in rs],
            "measured_best_tok_s": max(r["tok_s"] for r in rs),
            "live_per_token": live,
            "predicted_tok_s": res.tokens_per_s,
            "ratio": res.tokens_per_s / measured,
            "within_target": abs(res.tokens_per_s / measured - 1) <= TARGET,
            "policy": policy,
            "sim_fast_bytes": fast,
            "trace_records": len(records),
            "predicted_misses_per_token": res.misses_per_token,
            "predicted_bytes_per_token": res.bytes_per_token,
            "predicted_cpu_experts_per_token": res.cpu_experts_per_token,
            "bound_tok_s": report.bound.tokens_per_s,
        }
    return {
        "expert_bytes_tier1": x_bytes,
        "expert_bytes_stored": s_bytes,
        "sim_expert_bytes": sim_x,
        "kv_room_bytes": kv_room,
        "results": rows,
        "diagnosis": diag,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    add_model_arguments(ap, reps=5)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25], help="tier-1 budgets (x X)")
    ap.add_argument("--formats", nargs="+", default=["fp32", "int8"], choices=["fp32", "int8"])
    ap.add_argument(
        "--profile-k",
        type=int,
        default=None,
        help="row length of measure_profile's one-token matmul (default: --hidden)",
    )
    ap.add_argument("--json", action="store_true", help="also print the summary as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from freetoken_agents.engine.simulate.measure import measure_profile

    t0 = time.perf_counter()
    load_start = os.getloadavg()
    args.profile_k = args.profile_k or args.hidden
    # The tiered provider's Python measured between expert matmuls of this model's shape, as the
    # CPU-only engine runs it (tiny experts leave it warm caches: a miss ~27 us beside 64 x 64
    # experts, ~83 beside 512 x 1024 ones on the 2-core Xeon, one thread).
    profile = measure_profile(
        matmul_k=args.profile_k, moe_hidden=args.hidden, moe_intermediate=args.intermediate
    )
    with tempfile.TemporaryDirectory(prefix="ft-sim-validate-") as tmp:
        folder = Path(tmp) / "hf"
        model = build_model(folder, args)
        formats = {q: run_format(q, folder, Path(tmp), args, profile) for q in args.formats}
    summary = {
        "model": model,
        "threads": torch.get_num_threads(),
        "profile": {k: v for k, v in vars(profile).items()} if hasattr(profile, "__dict__") else str(profile),
        "prompt_tokens": args.prompt,
        "tokens": args.tokens,
        "reps": args.reps,
        "formats": formats,
        "wall_s": round(time.perf_counter() - t0, 1),
        "loadavg_start_end": [load_start[0], os.getloadavg()[0]],
    }
    p = profile
    print(
        f"Mixtral-shaped {model['params'] / 1e6:.0f}M params, {summary['threads']} threads; greedy decode of "
        f"{args.tokens - 1} tokens after {args.prompt}, median of {args.reps}\n"
        f"profile (measure_profile): memory {p.host_mem_gbps:.1f} GB/s "
        f"(one-token matmuls, K={args.profile_k}), cpu {p.cpu_gflops:.1f} GFLOP/s, "
        f"disk {p.disk_gbps:.2f} GB/s, device {p.device}\n"
        f"  copy {p.link_gbps:.1f} GB/s, overheads: layer {p.layer_overhead_us:.1f} us, "
        f"expert {p.expert_overhead_us:.1f} us, tier {p.tier_overhead_us:.1f} us, "
        f"miss {p.miss_overhead_us:.1f} us (+{p.stream_overhead_us:.1f} a STREAM)"
    )
    print(
        f"\n{'config':<20} {'measured':>9} {'best':>7} {'predicted':>9} {'pred/meas':>9} {'within 25%':>10} "
        f"{'live miss/t':>11} {'sim miss/t':>10} {'live host/t':>11} {'sim host/t':>10}"
    )
    ok, phases = True, []
    for q, fmt in formats.items():
        for name, r in fmt["results"].items():
            live = r["live_per_token"]
            ok &= r["within_target"] or name == "resident"
            print(
                f"{q + ' ' + name:<20} {r['measured_tok_s']:>9.1f} {r['measured_best_tok_s']:>7.1f} "
                f"{r['predicted_tok_s']:>9.1f} "
                f"{r['ratio']:>9.2f} {'yes' if r['within_target'] else 'NO':>10} "
                f"{live.get('stream', 0) + live.get('host', 0):>11.2f} "
                f"{r['predicted_misses_per_token']['fast']:>10.2f} {live.get('host', 0):>11.2f} "
                f"{r['predicted_cpu_experts_per_token']:>10.2f}"
            )
            if live:
                n_moe = model["layers"]
                extra = 1e3 / r["measured_tok_s"] - 1e3 / fmt["results"]["resident"]["measured_tok_s"]
                waits = live["phase[wait_prefetch]"] + live["phase[wait_storage]"]
                other = extra - 1e3 * (live["phase[predict]"] + live["phase[decode]"] + waits)
                phases.append(
                    f"  {q} {name}: "
                    + ", ".join(f"{p} {1e3 * live[f'phase[{p}]']:.2f}" for p in PHASES)
                    + f"; decode per promotion {1e3 * live['phase[decode]'] / max(live['stream'], 1e-9):.3f}"
                    + f"; vs resident +{extra:.2f} (predict, decode, other {other:.2f}"
                    + f" = {other / n_moe:.3f}/layer)"
                )
    print("live tiered phase times, ms per decode token (provider `phase_s`):", *phases, sep="\n")
    print("\ndiagnosis (resident engine, ms; measured vs machine model):")
    for q, fmt in formats.items():
        d = fmt["diagnosis"]
        print(
            f"  {q}: token {d['token_ms']:.2f} (model {d['model_token_ms']:.2f}); "
            f"experts {d['experts_ms_per_token']:.2f}/token over {d['moe_calls_per_token']:.0f} MoE calls, "
            f"rest {d['rest_ms_per_token']:.2f}/token "
            f"= {d['measured_rest_per_layer_ms']:.3f}/layer "
            f"(model dense {d['model_dense_per_layer_ms']:.3f}/layer, "
            f"{d['dense_per_layer_at_fp32_bytes_ms']:.3f} at fp32 bytes); one MoE call: "
            f"top-2 {d['moe_call_top2_ms']:.3f}, one expert {d['moe_call_one_expert_ms']:.3f} -> "
            f"per expert {d['measured_per_expert_ms']:.3f} (model {d['model_per_expert_ms']:.3f}), "
            f"fixed per call {d['measured_per_moe_call_fixed_ms']:.3f}"
        )
    verdict = "met" if ok else "NOT met"
    la = summary["loadavg_start_end"]
    print(
        f"\ntarget: tiered configs within {TARGET:.0%} -> {verdict} (wall {summary['wall_s']} s; "
        f"1-min load average {la[0]:.2f} at start, {la[1]:.2f} at end: other processes on these cores "
        "slow the measured side)"
    )
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
