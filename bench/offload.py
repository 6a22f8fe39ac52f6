"""Decode tokens/s with experts that do not fit in fast memory, contenders side by side in one run.

    python bench/offload.py --quick          # ~200 MB of experts, ~2 min on 2 cores
    python bench/offload.py                  # ~1.6 GB of experts (Mixtral-shaped, 8 layers)

A Mixtral-shaped model with random weights is built from a config, saved, and converted to FTW
with `convert_checkpoint(quant="fp32")`. Contenders, all greedy on the same prompt, all checked
token-for-token against (d):

  (a) freetoken_qstar     TieredExpertProvider: q* placement, pre-gating prefetch, shared fast LRU
                          with a pinned hot set; fast tier = --budget of expert bytes (+ KV room),
                          host tier = --host-budget of expert bytes.
  (b) accelerate_offload  THE BASELINE: transformers + accelerate disk offload, `device_map="auto"`
                          with `max_memory` (dense weights + the same --budget of expert bytes) and
                          `offload_folder`: what a Hugging Face user would do.
  (c) freetoken_lru       same budgets, prefetch off, always stream into a per-layer LRU, no hot
                          set (the mixtral-offloading design).
  (d) freetoken_ram       every expert decoded in RAM: the ceiling.

Method: each repetition runs every contender once, in a rotated order; before each contender's
timed phase the page cache is dropped (root: `sync; echo 1 > /proc/sys/vm/drop_caches`) and the
FreeToken tiers start empty, so tier 3 (the FTW file, or accelerate's offload folder) starts on
disk. The report says per contender whether every drop succeeded. Dense weights of every
contender are copied into owned RAM first, so a drop only evicts what is meant to live on disk.
Figures are medians over repetitions. Re-reads inside one timed phase may be served from the page
cache, alike for every contender.

Threads: on a shared 2-core machine two OpenMP threads per process collapse (each parallel region
waits for a descheduled worker: ~24 ms stalls, measured 5 tok/s vs 40 tok/s with one thread), so
`--threads` defaults to the faster of 1..cpu_count measured on (d) and is used for every contender.

Bounds: `touched` = bytes of the experts a decode token routes to (top_k x MoE layers x expert
bytes); `storage_bw` = cold sequential read of the FTW expert blocks after a drop; `ram_bw` = a
measured RAM copy rate. The disk bound (every touched expert read from disk) is touched/storage_bw;
(a)'s own bound is its measured file bytes per token / storage_bw + touched / ram_bw.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("bench.offload")


def drop_page_cache() -> bool:
    """Drop the OS page cache (needs root); True if it worked."""
    try:
        subprocess.run(["sync"], check=False)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def build_model(folder: Path, quick: bool) -> dict[str, int]:
    """Save a random Mixtral-shaped checkpoint into `folder`; returns its shape."""
    from transformers import MixtralConfig, MixtralForCausalLM

    h, inter, layers = (512, 1024, 4) if quick else (1024, 2048, 8)
    cfg = MixtralConfig(
        vocab_size=2048, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=1024, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    return {"hidden": h, "intermediate": inter, "layers": layers, "experts": 8, "top_k": 2, "params": params}


def own_weights(module: torch.nn.Module) -> None:
    """Copy every materialised parameter/buffer into owned memory (no mmapped file pages)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.device.type != "meta":
                t.data = t.data.clone()


def storage_bandwidth(ftw_path: Path) -> float:
    """Bytes/s of a cold read of every expert block (page cache dropped first; 0 if it cannot)."""
    from freetoken_agents.engine.ftw import FTWFile

    if not drop_page_cache():
        return 0.0
    with FTWFile(ftw_path) as f:
        infos = [f.expert_info(*k) for k in f.expert_keys()]
        fd = os.open(ftw_path, os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            n = sum(len(os.pread(fd, i.stored_length, i.data_offset)) for i in infos)
            dt = time.perf_counter() - t0
        finally:
            os.close(fd)
    return n / dt


def ram_bandwidth() -> float:
    """Bytes/s of copying a 256 MiB fp32 tensor (median of 5)."""
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return src.numel() * 4 / statistics.median(times)


# ---- timing ---------------------------------------------------------------------------------------
def time_engine(engine: Any, prompt: list[int], n: int) -> dict[str, Any]:
    """Prefill (timed apart) then n-1 greedy decode steps."""
    with engine.new_session() as s:
        t0 = time.perf_counter()
        tok = int(s.prefill(prompt, last_only=True)[0].argmax())
        t1 = time.perf_counter()
        out = [tok]
        for _ in range(n - 1):
            tok = int(s.decode(tok).argmax())
            out.append(tok)
        t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "tok_s": (n - 1) / (t2 - t1), "tokens": out}


def time_hf(model: Any, prompt: list[int], n: int) -> dict[str, Any]:
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache()
        t0 = time.perf_counter()
        out = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        tok = int(out.logits[0, -1].argmax())
        t1 = time.perf_counter()
        toks = [tok]
        for _ in range(n - 1):
            out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            tok = int(out.logits[0, -1].argmax())
            toks.append(tok)
        t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "tok_s": (n - 1) / (t2 - t1), "tokens": toks}


def pick_threads(engine: Any, prompt: list[int]) -> tuple[int, dict[int, float]]:
    """The thread count (1..cpu_count) with the best median decode rate on `engine`."""
    rates: dict[int, float] = {}
    for nt in range(1, (os.cpu_count() or 1) + 1):
        torch.set_num_threads(nt)
        time_engine(engine, prompt[:4], 3)
        rates[nt] = statistics.median(time_engine(engine, prompt, 8)["tok_s"] for _ in range(3))
    best = max(rates, key=rates.__getitem__)
    torch.set_num_threads(best)
    return best, rates


# ---- contenders -----------------------------------------------------------------------------------
class Bench:
    """Holds the model files and builds each contender's runner."""

    def __init__(self, tmp: Path, args: argparse.Namespace) -> None:
        from freetoken_agents.engine import Engine
        from freetoken_agents.engine.ftw.convert import convert_checkpoint

        self.args, self.tmp = args, tmp
        self.folder, self.ftw = tmp / "hf", tmp / "model.ftw"
        t0 = time.perf_counter()
        self.shape = build_model(self.folder, args.quick)
        convert_checkpoint(self.folder, self.ftw, quant="fp32", progress=False)
        self.ram = Engine.from_pretrained(self.folder)
        own_weights(self.ram.model)
        self.expert_bytes = self.ram.experts.nbytes
        self.build_s = time.perf_counter() - t0
        self.hf: Any = None
        self.last_stats: dict[str, Any] = {}

    def tiered(self, placement: str, prefetch: bool) -> Callable[[list[int], int], dict[str, Any]]:
        from freetoken_agents.engine import Engine
        from freetoken_agents.engine.memory import MemoryBudget, TieredExpertProvider

        eng = Engine.from_pretrained(self.ftw)
        own_weights(eng.model)
        kv_room = 8 * eng.kv_pool.bytes_per_block
        budget = MemoryBudget(
            fast_bytes=int(self.args.budget * self.expert_bytes) + kv_room,
            host_bytes=int(self.args.host_budget * self.expert_bytes),
        )
        tp = TieredExpertProvider.for_engine(eng, self.ftw, budget, placement=placement, prefetch=prefetch)

        def run(prompt: list[int], n: int) -> dict[str, Any]:
            read0 = tp.ftw.bytes_read
            r = time_engine(eng, prompt, n)
            st = tp.stats()
            tp.close()
            fast, host = st["tiers"]["fast"], st["tiers"]["host"]
            pf = st["prefetch"] or {}
            r.update({
                "fast_hit_rate": fast["hits"] / max(1, fast["hits"] + fast["misses"]),
                "host_hit_rate": host["hits"] / max(1, host["hits"] + host["misses"]),
                "decisions": st["policy"]["decisions"],
                "prefetch_precision": pf.get("precision"), "prefetch_recall": pf.get("recall"),
                "file_bytes_per_call": (tp.ftw.bytes_read - read0),
                "storage_bw_estimate": st["bandwidth"]["storage->host"]["estimate_bps"],
            })
            return r

        return run

    def accelerate(self) -> Callable[[list[int], int], dict[str, Any]]:
        from transformers import AutoModelForCausalLM

        if self.hf is None:  # loaded once: its cold state is the page cache alone
            dense = self.shape["params"] * 4 - self.expert_bytes
            max_mem = int(dense + self.args.budget * self.expert_bytes)
            self.hf = AutoModelForCausalLM.from_pretrained(
                self.folder, device_map="auto", max_memory={"cpu": max_mem},
                offload_folder=str(self.tmp / "offload"), dtype=torch.float32,
            ).eval()
            own_weights(self.hf)
        return lambda prompt, n: time_hf(self.hf, prompt, n)

    def in_ram(self) -> Callable[[list[int], int], dict[str, Any]]:
        return lambda prompt, n: time_engine(self.ram, prompt, n)

    def make(self, name: str) -> Callable[[list[int], int], dict[str, Any]]:
        return {
            "freetoken_qstar": lambda: self.tiered("qstar", True),
            "accelerate_offload": self.accelerate,
            "freetoken_lru": lambda: self.tiered("stream", False),
            "freetoken_ram": self.in_ram,
        }[name]()


CONTENDERS = ("freetoken_qstar", "accelerate_offload", "freetoken_lru", "freetoken_ram")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model (~200 MB of experts), ~2 min")
    ap.add_argument("--budget", type=float, default=0.25, help="fast-tier fraction of expert bytes")
    ap.add_argument("--host-budget", type=float, default=0.25, help="host-tier fraction of expert bytes")
    ap.add_argument("--tokens", type=int, default=None, help="decode tokens per timed phase")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (medians are reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: measured best)")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    n = args.tokens or (12 if args.quick else 24)
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ft-offload-") as tmp:
        b = Bench(Path(tmp), args)
        prompt = torch.randint(0, 2048, (16,), generator=torch.Generator().manual_seed(1)).tolist()
        if args.threads:
            torch.set_num_threads(args.threads)
            threads, thread_rates = args.threads, {}
        else:
            threads, thread_rates = pick_threads(b.ram, prompt)
        ref = time_engine(b.ram, prompt, n)["tokens"]
        storage_bw, ram_bw = storage_bandwidth(b.ftw), ram_bandwidth()
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
        for rep in range(args.reps):
            order = CONTENDERS[rep % len(CONTENDERS):] + CONTENDERS[: rep % len(CONTENDERS)]
            for name in order:
                run = b.make(name)
                gc.collect()
                dropped = drop_page_cache()
                r = run(prompt, n)
                r["page_cache_dropped"] = dropped
                r["same_tokens_as_ram"] = r.pop("tokens") == ref
                runs[name].append(r)
                logger.info("rep %d %s %.2f tok/s", rep, name, r["tok_s"])
        summary = report(b, runs, n, threads, thread_rates, storage_bw, ram_bw, load0)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(summary, indent=2, default=str))
    res = summary["results"]
    tps = " | ".join(f"{c} {res[c]['tok_s']:.2f}" for c in CONTENDERS)
    print(f"decode tok/s (median of {args.reps}): {tps}")
    bound = summary["bound"]
    print(
        f"ratios: a/b {summary['ratio_a_over_b']:.2f}x  a/c {summary['ratio_a_over_c']:.2f}x  "
        f"a/d {summary['ratio_a_over_d']:.2f}; (a) s/token {1 / res['freetoken_qstar']['tok_s']:.4f} "
        f"vs its bound {bound['a_bound_s_per_token']:.4f} ({bound['a_over_bound']:.2f}x)"
    )
    return 0


def report(b: Bench, runs: dict[str, list[dict[str, Any]]], n: int, threads: int,
           thread_rates: dict[int, float], storage_bw: float, ram_bw: float,
           load0: tuple[float, float, float]) -> dict[str, Any]:
    """Medians, ratios and bounds as one JSON-able dict."""
    res: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        res[name] = {
            "tok_s": statistics.median(r["tok_s"] for r in rs),
            "tok_s_all": [round(r["tok_s"], 3) for r in rs],
            "prefill_s": statistics.median(r["prefill_s"] for r in rs),
            "page_cache_dropped_every_rep": all(r["page_cache_dropped"] for r in rs),
            "same_tokens_as_ram": all(r["same_tokens_as_ram"] for r in rs),
        }
        for k in ("fast_hit_rate", "host_hit_rate", "prefetch_precision", "prefetch_recall"):
            if rs[0].get(k) is not None:
                res[name][k] = round(statistics.median(r[k] for r in rs), 3)
        if "decisions" in rs[0]:
            res[name]["decisions_last_rep"] = rs[-1]["decisions"]
            res[name]["file_bytes_per_token"] = statistics.median(r["file_bytes_per_call"] for r in rs) / n
    sh = b.shape
    touched = sh["top_k"] * sh["layers"] * b.expert_bytes // (sh["layers"] * sh["experts"])
    a = res["freetoken_qstar"]
    disk_bound = touched / storage_bw if storage_bw else None
    a_bound = (a["file_bytes_per_token"] / storage_bw if storage_bw else 0.0) + touched / ram_bw
    return {
        "model": {**sh, "expert_bytes": b.expert_bytes, "build_s": round(b.build_s, 1)},
        "budget_fraction": b.args.budget, "host_budget_fraction": b.args.host_budget,
        "decode_tokens": n, "reps": b.args.reps, "threads": threads,
        "decode_tok_s_by_threads_on_d": thread_rates, "loadavg_at_start": load0,
        "loadavg_at_end": os.getloadavg(),
        "results": res,
        "ratio_a_over_b": a["tok_s"] / res["accelerate_offload"]["tok_s"],
        "ratio_a_over_c": a["tok_s"] / res["freetoken_lru"]["tok_s"],
        "ratio_a_over_d": a["tok_s"] / res["freetoken_ram"]["tok_s"],
        "bound": {
            "touched_bytes_per_token": touched,
            "storage_bw_Bps": storage_bw, "ram_bw_Bps": ram_bw,
            "disk_bound_s_per_token": disk_bound,
            "ram_bound_s_per_token": touched / ram_bw,
            "a_bound_s_per_token": a_bound,
            "a_over_bound": (1 / a["tok_s"]) / a_bound,
        },
    }


if __name__ == "__main__":
    sys.exit(main())
