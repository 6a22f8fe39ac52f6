"""Tiered decode of an int8 FTW file on the CPU: int8 experts kept int8 in tier 1 vs decoded.

    python bench/tiered_int8.py            # Mixtral-shaped, 8 layers, 1.61 GB of fp32 experts, ~5 min
    python bench/tiered_int8.py --quick    # 4 layers, 0.13 GB, ~1 min

The model of bench/offload.py (random weights, unit-std embeddings so routing looks trained),
converted with `quant="int8"` (what `freetoken convert --quant int8` writes). The same RAM for
both contenders, in fractions of the experts' fp32 bytes E (what tier 1 held per expert before
int8 was kept): tier 1 --budget (0.125) x E + room for 8 KV blocks, tier 2 --host-budget
(0.125) x E. Tier 3 is the file, read with O_DIRECT; the page cache is dropped before each timed
phase (root) and the file after every forward.

Contenders, greedy from the same 16-token prompt:
  (a) int8_kept     placement "qstar", expert_quant "auto": tier 1 holds int8 projections with
                    their row scales (views of the stored block: a promote moves the block, no
                    decode), computed by the fused int8 kernel; HOST computes from the same bytes.
  (b) decoded       placement "qstar", expert_quant "none": tier 1 holds each expert decoded to
                    fp32 (4x the room), as the tiered engine did before.
  (c) resident      every expert in RAM as int8 (expert_quant "auto"): the ceiling of (a); (a)'s
                    tokens must equal it (same weights, same kernel, same summation order).
Prints tok/s (median over --reps, contenders rotated each repetition), experts held in tier 1
at the end, tier-1 hit rate and disk MB per decode token, and the ratios a/b and a/c.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _offload_tools import Evictor, build_model, drop_page_cache, pick_threads, time_engine  # noqa: E402

CONTENDERS = ("int8_kept", "decoded", "resident")


def run_tiered(ftw: Path, quant: str, budget: Any, prompt: list[int], n: int) -> dict[str, Any]:
    from freetoken_agents.engine import Engine

    eng = Engine.from_pretrained(ftw, memory=budget, placement="qstar", expert_quant=quant)
    tp = eng.experts
    r = time_engine(eng, prompt, n, Evictor([ftw]))
    st = tp.stats()["tiers"]
    r["tier1_experts"] = len(tp.fast.keys())
    r["tier1_hit_rate"] = st["fast"]["hits"] / max(1, st["fast"]["hits"] + st["fast"]["misses"])
    r["file_reads"] = st["storage"]["reads"]
    tp.close()
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model (4 layers), ~1 min")
    ap.add_argument("--budget", type=float, default=0.125, help="tier 1, fraction of the fp32 expert bytes")
    ap.add_argument(
        "--host-budget", type=float, default=0.125, help="tier 2, fraction of the fp32 expert bytes"
    )
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per timed phase")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (medians are reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: measured best)")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = ap.parse_args()

    from freetoken_agents.engine import Engine
    from freetoken_agents.engine.loading.convert import convert_checkpoint
    from freetoken_agents.engine.memory import MemoryBudget

    with tempfile.TemporaryDirectory(prefix="ft-int8-") as tmp:
        t0 = time.perf_counter()
        folder, ftw = Path(tmp) / "hf", Path(tmp) / "int8.ftw"
        shape = build_model(folder, args.quick)
        convert_checkpoint(folder, ftw, quant="int8", progress=False)
        resident = Engine.from_pretrained(ftw)
        fp32_experts = shape["layers"] * shape["experts"] * 3 * shape["hidden"] * shape["intermediate"] * 4
        kv_room = 8 * resident.kv_pool.bytes_per_block
        budget = MemoryBudget(
            fast_bytes=int(args.budget * fp32_experts) + kv_room,
            host_bytes=int(args.host_budget * fp32_experts),
        )
        prompt = torch.randint(0, shape["vocab"], (16,), generator=torch.Generator().manual_seed(1)).tolist()
        if args.threads:
            torch.set_num_threads(args.threads)
        else:
            pick_threads(resident, prompt)
        build_s = time.perf_counter() - t0
        ref = time_engine(resident, prompt, args.tokens, Evictor([]))["tokens"]
        runners = {
            "int8_kept": lambda: run_tiered(ftw, "auto", budget, prompt, args.tokens),
            "decoded": lambda: run_tiered(ftw, "none", budget, prompt, args.tokens),
            "resident": lambda: time_engine(resident, prompt, args.tokens, Evictor([])),
        }
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
        for rep in range(args.reps):
            for name in CONTENDERS[rep % 3 :] + CONTENDERS[: rep % 3]:
                gc.collect()
                drop_page_cache()
                runs[name].append(runners[name]())
    med = {
        c: {
            k: statistics.median(r[k] for r in rs)
            for k in ("tok_s", "disk_bytes_per_token", "tier1_experts", "tier1_hit_rate")
            if k in rs[0]
        }
        for c, rs in runs.items()
    }
    summary = {
        "model": {**shape, "fp32_expert_bytes": fp32_experts, "build_s": round(build_s, 1)},
        "threads": torch.get_num_threads(),
        "budget_bytes": {"fast": budget.fast_bytes, "host": budget.host_bytes},
        "results": med,
        "a_same_tokens_as_resident": all(r["tokens"] == ref for r in runs["int8_kept"]),
        "ratio_a_over_b": med["int8_kept"]["tok_s"] / med["decoded"]["tok_s"],
        "ratio_a_over_c": med["int8_kept"]["tok_s"] / med["resident"]["tok_s"],
        "reps": args.reps,
    }
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    a, b = med["int8_kept"], med["decoded"]
    print(
        f"decode tok/s (median of {args.reps}): "
        + " | ".join(f"{c} {med[c]['tok_s']:.2f}" for c in CONTENDERS)
        + f"; a/b {summary['ratio_a_over_b']:.2f}x, a/c {summary['ratio_a_over_c']:.2f}"
    )
    print(
        f"tier-1 experts held: a {a['tier1_experts']:.0f}, b {b['tier1_experts']:.0f}; tier-1 hit rate: "
        f"a {a['tier1_hit_rate']:.2f}, b {b['tier1_hit_rate']:.2f}; disk MB per decode token: "
        f"a {a['disk_bytes_per_token'] / 1e6:.1f}, b {b['disk_bytes_per_token'] / 1e6:.1f}; "
        f"(a) tokens equal (c)'s: {summary['a_same_tokens_as_resident']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
