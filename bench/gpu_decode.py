"""Decode at the memory bound on a CUDA GPU: the engine all-resident and tiered vs transformers and
vs what the HBM and the PCIe link allow.

    python bench/gpu_decode.py [--layers 8] [--tokens 32] [--budgets 0.25,0.5,1.0] [--json OUT]
    python bench/gpu_decode.py --tiered-only --budgets 0.25 --quant bf16,fp8,int8,mxfp4
    python bench/gpu_decode.py --tiered-only --budgets '' --compact     # 4-bit resident experts

Needs a CUDA GPU (without one it says so in one line and exits 1). Model: Qwen3-30B-A3B
dimensions (hidden 2048, 128 experts top-8, moe_intermediate 768, 32 q / 4 kv heads, head_dim
128, vocab 151,936) with --layers decoder layers, bf16, random weights drawn on the GPU (token
embeddings with std 1 so routing spreads as a trained model's does, see bench/offload.py), saved
once to FT_BENCH_DIR (default a folder beside the checkout: a real disk, not tmpfs).

Contenders, all from the same 16-token prompt, --tokens teacher-forced decode tokens each,
`--reps` rounds (medians), each timed around its decode calls with CUDA synchronisation:
  transformers eager / grouped_mm / batched_mm   experts_implementation of transformers 5
  engine resident (graph)    every expert on the GPU, decode replayed as a CUDA graph
  engine resident (eager)    the same with cuda_graphs=False
  engine tiered f=<b>        placement "qstar", fast budget b x the expert bytes (+ KV room),
                             every expert in pinned host RAM (tier 2); steady state: timed after
                             --warmup rounds
  engine tiered <q> f=<b>    the same with the experts stored as --quant q (fp8, int8, mxfp4:
                             tier 2 holds the compact bytes, the link moves them, the GPU decodes;
                             q:compact, e.g. mxfp4:compact: tier 1 keeps them as they arrived,
                             expert_quant="compact", so the same budget holds ~3.8x the experts)
  engine resident mxfp4 compact (eager)    --compact: the experts stored as MXFP4 and held in
                             that form on the GPU (expert_quant="compact"), decode steps through
                             the MXFP4 GEMV kernel (engine/kernels/mxfp4.py), against the bf16 resident
                             engine (eager); its "of HBM bound" column is against bf16's bytes
Bounds:
  HBM: bytes one decode token reads (top-8 routed experts, attention, norms, one embedding row,
       lm_head) / the device-to-device copy bandwidth measured here (read + write bytes).
  PCIe (tiered): bytes copied host -> device per decode token (the provider's counter) / the
       pinned host -> device bandwidth measured here.
Targets (issue 24): resident >= 2x transformers' best, >= 30% of the HBM bound, per-layer
overhead <= 100 us; tiered at 1.0 >= 90% of resident, at 0.25 within 1.5x of the PCIe bound.
Issue 21 (--quant): at 0.25, MXFP4 moves <= 0.3x the host -> device bytes per token of bf16 and
decodes >= 2x its tokens per second; the report says how many experts each codec fits in the
host budget of the bf16 experts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

QWEN3_30B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def build(folder: Path, layers: int) -> tuple[Any, int]:
    """The random bf16 model on the GPU (kept for the transformers contenders) and saved to
    `folder`; returns (model, expert bytes)."""
    import transformers

    config = transformers.Qwen3MoeConfig(num_hidden_layers=layers, **QWEN3_30B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 1.0 if "embed_tokens" in name else 0.02)
    model.eval()
    model.save_pretrained(folder)
    c = QWEN3_30B
    expert = 3 * c["hidden_size"] * c["moe_intermediate_size"] * 2
    return model, expert * c["num_experts"] * layers


def bytes_per_token(layers: int) -> int:
    """Weight bytes one decode token reads (bf16): routed experts, attention, norms, router, one
    embedding row, lm_head. (The KV of a 48-token context is negligible beside them.)"""
    c = QWEN3_30B
    h, d = c["hidden_size"], c["head_dim"]
    attn = h * d * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2) + 2 * d
    experts = c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"]
    router = c["num_experts"] * h
    per_layer = attn + experts + router + 2 * h
    return 2 * (layers * per_layer + h + c["vocab_size"] * h + h)


def device_bandwidth() -> float:
    """Bytes/s moved by a 1 GiB device-to-device copy (read + write), CUDA events, median of 5."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(8):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)


def pinned_bandwidth() -> float:
    sys.path.insert(0, str(Path(__file__).parent))
    from _offload_tools import pinned_h2d_bandwidth

    return pinned_h2d_bandwidth(torch.device("cuda"))


def time_hf(model: Any, prompt: list[int], forced: list[int], reps: int) -> float:
    """Median seconds per decode token of transformers with a DynamicCache."""
    from decode import crop_to  # bench/decode.py's version-proof cache crop

    from freetoken_agents.recipes.tiny.forward import cache_argument

    with torch.no_grad():
        out = model(torch.tensor([prompt], device="cuda"), use_cache=True)
        cache = out.get("cache") or out.get("past_key_values")
        arg = cache_argument(model)
        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for t in forced:
                model(torch.tensor([[t]], device="cuda"), use_cache=True, **{arg: cache})
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / len(forced))
            crop_to(cache, len(prompt))
    return statistics.median(times[1:])


def time_engine(engine: Any, prompt: list[int], forced: list[int], reps: int) -> float:
    """Median seconds per decode token (a session at the prompt, rolled back after each round)."""
    with engine.new_session() as s:
        s.prefill(prompt, last_only=True)
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for t in forced:
                s.decode(t)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / len(forced))
            s.truncate(len(prompt))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="tiered: rounds before timing")
    parser.add_argument("--budgets", default="0.25,0.5,1.0", help="tiered fast budgets ('' to skip)")
    parser.add_argument(
        "--quant", default="bf16", help="tiered: expert codecs to compare, e.g. bf16,mxfp4,mxfp4:compact"
    )
    parser.add_argument("--tiered-only", action="store_true", help="skip transformers and resident")
    parser.add_argument("--compact", action="store_true", help="also resident MXFP4 experts held 4-bit")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    quants = [q for q in args.quant.split(",") if q]
    unknown = sorted({q.split(":")[0] for q in quants} - {"bf16", "fp8", "int8", "mxfp4"})
    modes = sorted({q.split(":")[1] for q in quants if ":" in q} - {"auto", "compact"})
    if unknown or modes:
        parser.error(
            f"--quant: unknown codec(s) or mode(s) {', '.join(unknown + modes)}; choose from bf16, fp8, "
            "int8, mxfp4, each optionally with :compact (tier 1 keeps the stored form)"
        )
    if not torch.cuda.is_available():
        print("bench/gpu_decode.py needs a CUDA GPU: torch.cuda.is_available() is False here")
        return 1
    sys.path.insert(0, str(Path(__file__).parent))
    torch.set_grad_enabled(False)
    root = Path(os.environ.get("FT_BENCH_DIR", Path(__file__).resolve().parents[1] / ".bench-tmp"))
    root.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "layers": args.layers}
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, QWEN3_30B["vocab_size"], (16,), generator=g).tolist()
    forced = torch.randint(0, QWEN3_30B["vocab_size"], (args.tokens,), generator=g).tolist()
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        folder = Path(tmp) / "model"
        t0 = time.perf_counter()
        hf, expert_bytes = build(folder, args.layers)
        print(
            f"model: Qwen3-30B-A3B dims, {args.layers} layers, bf16, built and saved in "
            f"{time.perf_counter() - t0:.0f}s"
        )
        hbm, pcie = device_bandwidth(), pinned_bandwidth()
        need = bytes_per_token(args.layers)
        bound_s = need / hbm
        out.update(hbm_Bps=hbm, pcie_Bps=pcie, bytes_per_token=need, expert_bytes=expert_bytes)
        print(
            f"{out['gpu']}: device copy {hbm / 1e12:.2f} TB/s, pinned host->device {pcie / 1e9:.1f} GB/s; "
            f"{need / 1e9:.2f} GB read per decode token -> HBM bound {1 / bound_s:.0f} tok/s"
        )
        rates: dict[str, float] = {}
        if not args.tiered_only:
            baselines(hf, folder, prompt, forced, args.reps, rates, out)
        del hf
        torch.cuda.empty_cache()
        if args.compact:
            compact_resident(folder, Path(tmp) / "compact.ftw", prompt, forced, args, rates, out)
        tiered: dict[str, Any] = {}
        for quant in quants:
            for b in [float(x) for x in args.budgets.split(",") if x]:
                name = f"engine tiered f={b}" if quant == "bf16" else f"engine tiered {quant} f={b}"
                cache = Path(tmp) / "ftw"
                tiered[name] = run_tiered(folder, cache, quant, b, expert_bytes, prompt, forced, args)
                tiered[name]["pcie_bound_tok_s"] = (
                    pcie / tiered[name]["bytes_per_token"] if tiered[name]["bytes_per_token"] > 0 else None
                )  # nothing copied at steady state (every expert stays in tier 1): no link bound
                rates[name] = tiered[name]["tok_s"]
    report(rates, tiered, bound_s, args.layers, out)
    if args.json:
        args.json.write_text(json.dumps({**out, "tok_s": rates, "tiered": tiered}, indent=2))
    return 0


def baselines(
    hf: Any, folder: Path, prompt: list[int], forced: list[int], reps: int, rates: dict, out: dict
) -> None:
    """transformers' experts implementations and the all-resident engine (graph and eager)."""
    from freetoken_agents.engine import Engine

    for impl in ("eager", "grouped_mm", "batched_mm"):
        try:
            hf.set_experts_implementation(impl)
            rates[f"transformers {impl}"] = 1 / time_hf(hf, prompt, forced, reps)
        except Exception as e:  # an implementation this transformers/torch lacks
            print(f"transformers {impl}: not measured ({type(e).__name__}: {str(e)[:120]})")
    resident = Engine.from_pretrained(folder, device="cuda", dtype=torch.bfloat16, placement="resident")
    rates["engine resident (graph)"] = 1 / time_engine(resident, prompt, forced, reps)
    graphs = resident.decode_runner.graphs
    out["graph"] = None if graphs is None else {"captures": graphs.captures, "replays": graphs.replays}
    del resident
    torch.cuda.empty_cache()
    eager = Engine.from_pretrained(
        folder, device="cuda", dtype=torch.bfloat16, placement="resident", cuda_graphs=False
    )
    rates["engine resident (eager)"] = 1 / time_engine(eager, prompt, forced, reps)
    del eager
    torch.cuda.empty_cache()


def compact_resident(
    folder: Path, ftw: Path, prompt: list[int], forced: list[int], args: argparse.Namespace,
    rates: dict, out: dict,
) -> None:  # fmt: skip
    """Resident experts stored as MXFP4 and held 4-bit on the GPU (expert_quant="compact") vs the
    bf16 resident engine, both eager (compact experts are not stacked, so not graph-captured)."""
    from freetoken_agents.engine import Engine
    from freetoken_agents.engine.kernels.mxfp4 import kernel_ok
    from freetoken_agents.engine.loading.convert import convert_checkpoint

    if "engine resident (eager)" not in rates:
        eager = Engine.from_pretrained(
            folder, device="cuda", dtype=torch.bfloat16, placement="resident", cuda_graphs=False
        )
        rates["engine resident (eager)"] = 1 / time_engine(eager, prompt, forced, args.reps)
        del eager
        torch.cuda.empty_cache()
    convert_checkpoint(folder, ftw, quant="mxfp4", progress=False)
    compact = Engine.from_pretrained(
        ftw,
        device="cuda",
        dtype=torch.bfloat16,
        placement="resident",
        expert_quant="compact",
        cuda_graphs=False,
    )
    rates["engine resident mxfp4 compact (eager)"] = 1 / time_engine(compact, prompt, forced, args.reps)
    out["compact"] = {
        "kernel_ok": kernel_ok(torch.device("cuda", torch.cuda.current_device())),
        "expert_bytes_resident": compact.experts.resident_bytes(),
    }
    del compact
    torch.cuda.empty_cache()
    print(f"compact: {out['compact']}")


def run_tiered(
    folder: Path, cache: Path, quant: str, budget: float, expert_bytes: int, prompt: list[int],
    forced: list[int], args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """The tiered engine on the experts stored as `quant`: fast budget `budget` x the (bf16)
    expert bytes plus KV room, tier 2 = the bf16 expert bytes; steady-state tok/s and host ->
    device bytes per token, and how many experts the host budget holds in this codec."""
    from freetoken_agents.engine import Engine
    from freetoken_agents.engine.memory import MemoryBudget

    codec, _, mode = quant.partition(":")
    memory = MemoryBudget(fast_bytes=int(budget * expert_bytes) + (256 << 20), host_bytes=expert_bytes)
    engine = Engine.from_pretrained(
        folder, device="cuda", dtype=torch.bfloat16, placement="qstar", memory=memory,
        cache_dir=cache, quant=codec, progress=False, expert_quant=mode or "auto",
    )  # fmt: skip
    tp = engine.experts
    time_engine(engine, prompt, forced, args.warmup)  # fill the tiers: steady state after
    before = engine.stats()["bytes_moved"]["host->fast"]
    s = time_engine(engine, prompt, forced, args.reps)
    moved = (engine.stats()["bytes_moved"]["host->fast"] - before) / (args.reps * len(forced))
    block = max(tp.moves.host_nbytes(k) for k in tp.ftw.expert_keys())  # tier-2 bytes per expert
    result = {
        "quant": quant,
        "tok_s": 1 / s,
        "bytes_per_token": moved,
        "tier2_bytes_per_expert": block,
        "experts_in_host_budget": expert_bytes // block,
        "tier1_bytes_per_expert": max(tp.fast_bytes.values()),
        "experts": len(tp.ftw.expert_keys()),
        "decisions": engine.stats()["policy"]["decisions"],
    }
    graphs = engine.decode_runner.graphs  # tier 1 as slots: the decode step as a CUDA graph
    result["graph"] = None if graphs is None else {
        "captures": graphs.captures, "replays": graphs.replays, "reruns": graphs.reruns,
    }  # fmt: skip
    tp.close()
    del engine
    torch.cuda.empty_cache()
    return result


def report(rates: dict[str, float], tiered: dict[str, Any], bound_s: float, layers: int, out: dict) -> None:
    best_hf = max((v for k, v in rates.items() if k.startswith("transformers")), default=float("nan"))
    print(f"\n{'contender':<34} {'tok/s':>8} {'ms/token':>9} {'us/layer':>9} {'of HBM bound':>13}")
    for name, r in rates.items():
        print(f"{name:<34} {r:8.1f} {1e3 / r:9.2f} {1e6 / r / layers:9.0f} {bound_s * r:12.1%}")
    res = rates.get("engine resident (graph)")
    if res is not None:
        overhead_us = (1 / res - bound_s) / layers * 1e6
        out["per_layer_overhead_us"] = overhead_us
        print(
            f"\nresident (graph): {res / best_hf:.2f}x transformers' best (target >= 2), "
            f"{bound_s * res:.1%} of the HBM bound (target >= 30%), {overhead_us:.0f} us per layer above "
            f"the bound (target <= 100); graph {out.get('graph')}"
        )
    for name, t in tiered.items():
        bound = t["pcie_bound_tok_s"]
        link = (
            f"{t['bytes_per_token'] / 1e6:.0f} MB/token host->device -> PCIe bound {bound:.0f} tok/s "
            f"({bound / t['tok_s']:.2f}x away)"
            if bound is not None
            else "no host->device copies at steady state (the link does not bound it)"
        )
        of_resident = f" = {t['tok_s'] / res:.0%} of resident" if res else ""
        print(
            f"{name}: {t['tok_s']:.1f} tok/s{of_resident}; {link}; tier 2 (the bf16 expert bytes) "
            f"holds {t['experts_in_host_budget']} experts of {t['tier2_bytes_per_expert'] / 1e6:.2f} MB; "
            f"q* {t['decisions']}; CUDA graph {t['graph']}"
        )
    print("targets: f=1.0 >= 90% of resident, f=0.25 within 1.5x of the PCIe bound (issue 24)")
    for name, t in tiered.items():  # issue 21: each compact codec against bf16 at the same budget
        if t["quant"] == "bf16":
            continue
        base = tiered.get(name.replace(f" {t['quant']}", ""))
        if base is None:
            continue
        bf16_bytes = base["bytes_per_token"]
        bytes_ratio = t["bytes_per_token"] / bf16_bytes if bf16_bytes else float("nan")
        print(
            f"{name} vs bf16: {bytes_ratio:.2f}x the host->device bytes per token, "
            f"{t['tok_s'] / base['tok_s']:.2f}x the tok/s, "
            f"{t['experts_in_host_budget'] / base['experts_in_host_budget']:.1f}x the experts in tier 2 "
            "(targets for mxfp4 at 0.25: bytes <= 0.3x, tok/s >= 2x)"
        )


if __name__ == "__main__":
    sys.exit(main())
