"""Tiered vs resident decode on the CPU, fp32 and int8 FTW files, against each tiered run's bound.

    python bench/tiered_decode.py            # Mixtral-shaped, ~101M parameters, ~2 min on 2 cores
    python bench/tiered_decode.py --layers 8 --formats hf    # issue 61's HF-folder spelling only
    python bench/tiered_decode.py --json     # also print the summary as JSON
    python bench/tiered_decode.py --slots    # also with tier 1 as a slot pool (off on CPUs)

Model: a random Mixtral-shaped checkpoint (defaults: hidden 512, intermediate 1024, 7 layers, 8
experts, top-2, vocab 8192: ~101M parameters, 88M of them in experts; unit-std embeddings so the
routing looks trained, as in bench/offload.py), converted with `quant="fp32"` and `quant="int8"`.
Every engine uses expert_quant "auto" (an int8 file keeps its int8 projections int8, in RAM and in
tier 1), so the engines of one file compute on identical weights and their tokens must be equal.

Configs, per file:
  resident       `Engine.from_pretrained(ftw)`: every expert in RAM, no tiers.
  tiered f=F     placement "qstar", TieringOptions() (the defaults users get), MemoryBudget with
                 fast_bytes = F x X + K and host_bytes = S + 16 MiB, where X = the experts' tier-1
                 bytes (the provider's `fast_bytes`, summed: fp32 4 B/weight; int8 kept: int8 +
                 row scales), S = their stored bytes (tier 2 holds stored blocks) and K = room for
                 the KV cache the engine charges to fast memory (the blocks prompt + --tokens
                 positions need, plus 2): fast memory is shared with the KV cache
                 (provider `_apply_fast_budget`: tier 1 gets fast_bytes minus the KV bytes), so at
                 F=1.0 every expert fits tier 1. Tier 2 can hold every expert: after warm-up
                 nothing is read from disk (`storage reads/token` is printed to show it).
  hf             (format "hf": issue 61's spelling, the HF checkpoint folder itself) resident
                 `Engine.from_pretrained(folder, dtype=float32)` against tiered "hf 1.5x/1x":
                 placement "qstar", MemoryBudget(fast_bytes=1.5 X, host_bytes=X), X the experts'
                 float32 bytes; the folder is converted to a cached FTW file on the way (a fast
                 budget with room to spare: every expert fits tier 1 and KV growth evicts none).
Each engine is warmed up (--warmup untimed greedy runs), then the configs are timed in rotated
order, --reps times: prefill of the --prompt-token prompt, then --tokens - 1 greedy decode steps
(argmax, no stop tokens); tok/s is decode tokens over decode seconds (bench/_offload_tools
`time_engine`); medians are reported.

Bound of a tiered config: the time per decode token it could reach if moving experts cost only
their bytes over the measured link bandwidths,
    t_bound = 1 / resident_tok_s + sum over links L of B_L / W_L,   bound tok/s = 1 / t_bound,
  resident_tok_s  the median decode rate of the resident engine on the same file (its compute);
  B_L             median bytes the tiered engine moved over link L per decode token during the
                  timed runs (`engine.stats()["bytes_moved"]`, sampled after prefill and at the end):
                  "host->fast" (a STREAM promotion: on the CPU the tier-2 block is decoded into
                  tier-1 weights, a view for fp32 and kept int8, timed as the "decode" phase),
                  "storage->host" (tier-3 reads; 0 after warm-up here) and "fast->host" (CUDA only);
  W_L             the bandwidth oracle's estimate for L at the end of the timed runs
                  (`engine.stats()["bandwidth"][L]["estimate_bps"]`; the prior when never sampled).
  Experts computed HOST (from their tier-2 bytes) add no term: for these files their decode is a
  view of the stored bytes (fp32 stored = fp32 compute; int8 kept int8), so they cost compute only,
  which the resident rate already prices. Host computations and promotions per decode token are
  printed (`policy` decisions, "decode/host" and "decode/stream").

Targets (issue 31, issue 61): tiered f=1.0 and hf 1.5x/1x >= 0.98x the resident engine; f=0.5 and
f=0.25 within 1.3x of their bound (tok/s >= bound / 1.3). The table: config, tok/s, ratio to
resident (same file), bound tok/s, ratio to bound, tier-1 experts held at the end (of all),
promotions (stream) and HOST computations per decode token, storage reads per decode token, MB
moved host->fast per decode token, tokens equal to resident's; then each tiered config's provider
phase times (`phase_s`: attention, experts, predict = pre-gating for prefetch, decode =
promotions, waits) in ms per decode token, to show where a gap to the bound goes.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _offload_tools import Evictor, time_engine  # noqa: E402

LINKS = ("storage->host", "host->fast", "fast->host")
PHASES = ("attention", "experts", "predict", "decode", "wait_prefetch", "wait_storage")
TARGET_FULL, TARGET_BOUND = 0.98, 1.3


def build_model(folder: Path, args: argparse.Namespace) -> dict[str, int]:
    """A random Mixtral-shaped checkpoint in `folder` (unit-std embeddings); its shape."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=max(1024, args.prompt + args.tokens),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    return {
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "layers": args.layers,
        "experts": args.experts,
        "top_k": 2,
        "vocab": args.vocab,
        "params": sum(p.numel() for p in model.parameters()),
    }


def tier_sizes(ftw: Path) -> tuple[int, int]:
    """(tier-1 bytes, stored bytes) of all experts, as the tiered provider counts them."""
    from freetoken_agents.engine import Engine, TieringOptions
    from freetoken_agents.engine.memory import MemoryBudget

    big = 4 * ftw.stat().st_size + (64 << 20)
    eng = Engine.from_pretrained(
        ftw,
        placement="qstar",
        memory=MemoryBudget(fast_bytes=big, host_bytes=big),
        tiering=TieringOptions(prefetch=False),
    )
    tp = eng.experts
    sizes = sum(tp.fast_bytes.values()), sum(tp.stored_bytes.values())
    tp.close()
    return sizes


def tiered_probes(eng: Any) -> dict[str, Any]:
    """Running totals sampled by `time_loop` after prefill and at the end (per-token growth)."""
    tp = eng.experts

    def moved(link: str) -> Any:
        return lambda: float(tp.moves.stats().get(link, 0))

    def decisions(kind: str) -> Any:
        return lambda: float(tp.policy.stats()["decisions_by_phase"].get(f"decode/{kind}", 0))

    probes = {f"moved[{link}]": moved(link) for link in LINKS}
    probes["stream"] = decisions("stream")
    probes["host"] = decisions("host")
    probes["storage_reads"] = lambda: float(tp.stats()["tiers"]["storage"]["reads"])
    for phase in PHASES:
        probes[f"phase[{phase}]"] = lambda phase=phase: float(tp.phases.stats()["phase_s"].get(phase, 0.0))
    return probes


def run_format(quant: str, folder: Path, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    from freetoken_agents.engine import Engine, TieringOptions
    from freetoken_agents.engine.loading.convert import convert_checkpoint
    from freetoken_agents.engine.memory import MemoryBudget

    ftw = tmp / f"{quant}.ftw"
    convert_checkpoint(folder, ftw, quant=quant, progress=False)
    x_bytes, s_bytes = tier_sizes(ftw)
    resident = Engine.from_pretrained(ftw)
    pool = resident.kv_pool
    kv_room = (math.ceil((args.prompt + args.tokens) / pool.block_size) + 2) * pool.bytes_per_block
    engines: dict[str, Any] = {"resident": resident}
    budgets: dict[str, dict[str, int]] = {}
    # Tier 1 as a slot pool (float experts, or int8 ones in slots of their own layout).
    slotted = [False, True] if args.slots else [False]
    for f in args.fractions:
        budget = MemoryBudget(fast_bytes=int(f * x_bytes) + kv_room, host_bytes=s_bytes + (16 << 20))
        for slots in slotted:
            name = f"tiered f={f:g}" + (" slots" if slots else "")
            budgets[name] = {"fast": budget.fast_bytes, "host": budget.host_bytes}
            engines[name] = Engine.from_pretrained(
                ftw, placement="qstar", memory=budget, tiering=TieringOptions(expert_slots=slots or None)
            )
    return {
        "expert_bytes_tier1": x_bytes,
        "expert_bytes_stored": s_bytes,
        "kv_room_bytes": kv_room,
        "file_bytes": ftw.stat().st_size,
        "results": time_configs(engines, budgets, args),
    }


def run_hf(folder: Path, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The HF-folder spelling of issue 61: both engines load the checkpoint folder (float32); the
    tiered one converts it to a cached FTW file and runs under MemoryBudget(fast_bytes=1.5 x the
    experts' bytes, host_bytes=1 x), no KV room added: everything fits tier 1 with room to spare."""
    from freetoken_agents.engine import Engine
    from freetoken_agents.engine.loading.placement import expert_bytes
    from freetoken_agents.engine.memory import MemoryBudget

    resident = Engine.from_pretrained(folder, dtype=torch.float32)
    x_bytes = expert_bytes(resident.model.spec, torch.float32)
    budget = MemoryBudget(fast_bytes=int(1.5 * x_bytes), host_bytes=x_bytes)
    name = "tiered hf 1.5x/1x"
    engines = {
        "resident": resident,
        name: Engine.from_pretrained(
            folder, dtype=torch.float32, placement="qstar", memory=budget, cache_dir=tmp / "cache"
        ),
    }
    budgets = {name: {"fast": int(budget.fast_bytes or 0), "host": int(budget.host_bytes or 0)}}
    return {
        "expert_bytes_tier1": x_bytes,
        "expert_bytes_stored": x_bytes,
        "kv_room_bytes": 0,
        "file_bytes": 0,
        "results": time_configs(engines, budgets, args),
    }


def time_configs(
    engines: dict[str, Any], budgets: dict[str, dict[str, int]], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Warm up, time every engine in rotated order (`--reps`), and summarise each tiered one
    against "resident" (the first engine); closes the tiered ones."""
    resident = engines["resident"]
    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    for eng in engines.values():
        for _ in range(args.warmup):
            time_engine(eng, prompt, args.tokens, Evictor([]))
    ref = time_engine(resident, prompt, args.tokens, Evictor([]))["tokens"]
    names = list(engines)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            gc.collect()
            eng = engines[name]
            probes = tiered_probes(eng) if name != "resident" else None
            runs[name].append(time_engine(eng, prompt, args.tokens, Evictor([]), probes))
    res_tok_s = statistics.median(r["tok_s"] for r in runs["resident"])
    rows: dict[str, dict[str, Any]] = {
        "resident": {"tok_s": res_tok_s, "same_tokens": all(r["tokens"] == ref for r in runs["resident"])}
    }
    for name in names[1:]:
        rs, tp = runs[name], engines[name].experts
        st = tp.stats()
        bw = {link: st["bandwidth"][link]["estimate_bps"] for link in LINKS if link in st["bandwidth"]}
        per_tok = {
            key: statistics.median(r[f"{key}_per_token"] for r in rs)
            for key in [f"moved[{link}]" for link in LINKS] + ["stream", "host", "storage_reads"]
        }
        bytes_per_tok = {link: per_tok[f"moved[{link}]"] for link in LINKS}
        t_bound = 1 / res_tok_s + sum(b / bw[link] for link, b in bytes_per_tok.items() if b and link in bw)
        tok_s = statistics.median(r["tok_s"] for r in rs)
        rows[name] = {
            "tok_s": tok_s,
            "ratio_to_resident": tok_s / res_tok_s,
            "bound_tok_s": 1 / t_bound,
            "ratio_to_bound": tok_s * t_bound,
            "bytes_per_token": bytes_per_tok,
            "bandwidth_bps": bw,
            "stream_per_token": per_tok["stream"],
            "host_per_token": per_tok["host"],
            "storage_reads_per_token": per_tok["storage_reads"],
            "phase_ms_per_token": {
                p: 1e3 * statistics.median(r[f"phase[{p}]_per_token"] for r in rs) for p in PHASES
            },
            "tier1_experts": len(tp.fast.keys()),
            "same_tokens": all(r["tokens"] == ref for r in rs),
            "budget_bytes": budgets[name],
        }
        tp.close()
    return rows


def add_model_arguments(ap: argparse.ArgumentParser, reps: int) -> None:
    """The model shape and timing options `build_model` and the timed runs read (shared with
    simulate_validate.py)."""
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per timed run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs per engine")
    ap.add_argument("--reps", type=int, default=reps, help="timed runs per config (medians are reported)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    add_model_arguments(ap, reps=7)
    ap.add_argument(
        "--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25], help="tier-1 budgets (x expert bytes)"
    )
    ap.add_argument(
        "--formats",
        nargs="+",
        default=["fp32", "int8", "hf"],
        choices=["fp32", "int8", "hf"],
        help="FTW files of these codecs; hf: the checkpoint folder itself (issue 61's spelling)",
    )
    ap.add_argument("--slots", action="store_true", help="each fraction also with tier 1 as slots")
    ap.add_argument("--json", action="store_true", help="also print the summary as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ft-tiered-decode-") as tmp:
        folder = Path(tmp) / "hf"
        shape = build_model(folder, args)
        formats = {
            q: run_hf(folder, Path(tmp), args) if q == "hf" else run_format(q, folder, Path(tmp), args)
            for q in args.formats
        }
    summary = {
        "model": shape,
        "threads": torch.get_num_threads(),
        "prompt_tokens": args.prompt,
        "tokens": args.tokens,
        "reps": args.reps,
        "formats": formats,
        "wall_s": round(time.perf_counter() - t0, 1),
    }

    print(
        f"Mixtral-shaped {shape['params'] / 1e6:.0f}M params ({shape['layers']} layers x {shape['experts']} "
        f"experts, hidden {shape['hidden']}, intermediate {shape['intermediate']}), {summary['threads']} "
        f"threads; greedy decode of {args.tokens - 1} tokens after {args.prompt}, median of {args.reps}"
    )
    head = (
        f"{'config':<26} {'tok/s':>7} {'x res':>6} {'bound':>7} {'x bnd':>6} {'tier1':>7} "
        f"{'strm/t':>6} {'host/t':>6} {'disk/t':>6} {'MB/t h->f':>9} {'same':>5}"
    )
    ok = True
    for q, fmt in formats.items():
        print(
            f"\n{q}: experts {fmt['expert_bytes_tier1'] / 1e6:.1f} MB in tier 1 form, "
            f"{fmt['expert_bytes_stored'] / 1e6:.1f} MB stored; KV room {fmt['kv_room_bytes'] / 1e6:.2f} MB"
        )
        print(head)
        n_experts = shape["layers"] * shape["experts"]
        phases: list[str] = []
        for name, r in fmt["results"].items():
            if name == "resident":
                print(f"{q + ' ' + name:<26} {r['tok_s']:>7.1f} {1.0:>6.2f} {'':>7} {'':>6} {'all':>7}")
                continue
            print(
                f"{q + ' ' + name:<26} {r['tok_s']:>7.1f} {r['ratio_to_resident']:>6.2f} "
                f"{r['bound_tok_s']:>7.1f} {r['ratio_to_bound']:>6.2f} "
                f"{r['tier1_experts']:>3}/{n_experts:<3} {r['stream_per_token']:>6.2f} "
                f"{r['host_per_token']:>6.2f} {r['storage_reads_per_token']:>6.2f} "
                f"{r['bytes_per_token']['host->fast'] / 1e6:>9.2f} {str(r['same_tokens']):>5}"
            )
            phases.append(
                f"  {q} {name}: " + ", ".join(f"{p} {v:.2f}" for p, v in r["phase_ms_per_token"].items())
            )
            if name.endswith("slots"):  # a comparison (the CPU default is no slots), no target
                continue
            if name == "tiered f=1" or q == "hf":
                ok &= r["ratio_to_resident"] >= TARGET_FULL
            else:
                ok &= r["ratio_to_bound"] >= 1 / TARGET_BOUND
        print("tiered phase times, ms per decode token (provider `phase_s`):", *phases, sep="\n")
    print(
        f"\ntargets: tiered f=1 and hf >= {TARGET_FULL}x resident; other fractions >= bound / {TARGET_BOUND} "
        f"-> {'met' if ok else 'NOT met'} (wall {summary['wall_s']} s)"
    )
    if args.json:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
