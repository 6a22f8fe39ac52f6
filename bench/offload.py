"""Decode tokens/s when the experts do not fit in RAM: FreeToken's tiered memory vs HF offloading.

    python bench/offload.py [--sweep]        # Mixtral-shaped, 1.96 GB fp32 (1.61 GB experts), 4-7 min
    python bench/offload.py --quick          # 0.2 GB, ~1 min (development)

Model: Mixtral-shaped (hidden 1024, expert intermediate 2048, 8 layers, 8 experts, top-2, vocab
32000, fp32), random weights from a fixed seed, saved, converted to FTW (`quant="fp32"`: the
same bytes every contender reads). Token embeddings are drawn with std 1 instead of 0.02:
with 0.02 the context-averaged attention output swamps the residual stream, every decode step
routes to the same ~2 experts per layer (measured: 95% of a layer's experts reused by the next
token, greedy output stuck on one token) and any cache wins. With std 1 routing looks like a
trained model's (printed under "routing"): consecutive decode tokens share an expert in 46% of
layer steps over the 23 timed tokens (52% over 64), as independent top-2 picks would (46%; the
Mixtral paper reports 46-63% for its trained model); per-layer max/min expert load 3-10x over 23
tokens (1.5-3x over 64); pre-gating precision 0.89 / 0.84 / 0.80 for 1 / 2 / 3 layers ahead. That
is the hard case for caching: most of what a token needs is not what the previous one used.

Budgets, the same bytes for every contender (fractions of the expert bytes E):
  fast tier  --budget (0.25)          tier 1 (+ room for 8 KV blocks)
  host tier  --host-budget (0.25)     tier 2
so half the experts fit in RAM and the other half live only on disk. accelerate gets
max_memory = dense weights + (budget + host_budget) x E: the same RAM for experts.

Contenders, greedy from the same 16-token prompt, each checked token for token against (d):
  (a) freetoken_qstar     TieredExpertProvider(placement="qstar"): q* placements, exclusive RAM
                          tiers, one fast LRU across layers with a pinned hot set, pre-gating
                          prefetch on two loader threads, tier 3 read with O_DIRECT
                          into buffers on huge pages.
  (b) accelerate_offload  transformers + accelerate disk offload: device_map="auto", max_memory,
                          offload_folder (what a Hugging Face user would do). transformers 5 keeps
                          a layer's experts fused ([E, 2I, H]), so an offloaded layer loads all E
                          experts per forward where FreeToken reads only the routed ones.
  (c) freetoken_lru       TieredExpertProvider(placement="stream", prefetch=False): the
                          mixtral-offloading design: a per-layer LRU of decoded expert copies in
                          tier 1 (the block stays in tier 2), always stream, no prefetch, no hot
                          set; same budgets, same tier 2 LRU and tier-3 reader.
  (d) freetoken_ram       every expert in RAM: the ceiling.

Tier 3 is the disk for everyone: before each contender's timed phase the page cache is dropped
(`sync; echo 1 > /proc/sys/vm/drop_caches`, root) and all tiers start empty; during the phase,
after every forward (prefill and each decode step), each contender's tier-3 files are dropped from
the page cache with posix_fadvise(DONTNEED) (accelerate: the checkpoint and the offload folder;
FreeToken: the FTW file, which it reads with O_DIRECT anyway). Otherwise the OS keeps every block
read once and serves the next "disk" read from RAM that no budget counts. The seconds spent in
those calls are taken out of the timings (reported as evict_s). Dense weights of every contender
are copied into owned RAM first, so a drop only evicts what is meant to live on disk. accelerate's
in-RAM layers are loaded before timing; FreeToken's tiers fill during the (separately timed)
prefill.

Each repetition runs every contender once in a rotated order; figures are medians. Threads: on a
shared 2-core machine a second OpenMP thread can stall on a descheduled worker, so --threads
defaults to the faster of 1..cpu_count measured on (d), and is used for every contender.
`--sweep` also runs (a) once at growing fast budgets to show it approaching (d).

Disk bytes per decode token come from /proc/self/io (read_bytes: what the kernel read from storage
for the process, O_DIRECT reads and mmap page faults alike), the same meter for every contender.

Reading a/b: both (a) and (b) wait on the disk, so as the link slows a/b tends to the ratio of
their disk bytes per token (printed: ~1087 MB for accelerate, which puts 5 of 8 decoder layers and
lm_head on disk at this budget and loads all 8 experts of each, against ~204 MB for (a), ~5.3x);
on a fast link accelerate's per-byte overheads (copies, hooks, serial compute) push a/b higher.
(a)'s ~204 MB is ~8 blocks per token of the 16 it routes to: replaying this model's routing
(bench/eviction.py), RAM for half the experts reads 8.9 blocks per token evicting the least
recently used, 7.8 evicting by decayed routing frequency (what q* does) and 3.7 with the offline
optimum that knows the future.

On a GPU (`--device cuda`, or `bash bench/cuda.sh` for the `cuda` tests and this bench in one go):
tier 1 is GPU memory, tier 2 pinned host memory, accelerate gets max_memory = {GPU: dense weights
+ budget x E, cpu: host_budget x E}; the fast link's bound is the bytes (a) copied host -> device
over a measured 64 MiB pinned copy, and the output compares (a)'s own copies (its oracle) with it.

Bounds: touched = bytes of the experts one decode token routes to (top_k x layers x expert
bytes); fast_bw = the tier 2 -> tier 1 link at its best (a RAM copy; on CUDA a pinned copy).
This shared machine's disk drifts from 0.3 to 3 GB/s within minutes, so the link bandwidth is
measured during each phase: for FreeToken, its own reads' bytes over the wall time during which
at least one read was in flight (`BlockReader.busy_seconds`: transfers only, checksums and waits
excluded); `LinkProbe` (O_DIRECT block-sized reads of a scratch file no contender reads, just
before and after each phase) is printed beside it. A phase's disk floor = its disk bytes per
token / link bandwidth; (a)'s bound per token = max(disk floor, touched / fast_bw; on CUDA its
host -> device bytes / fast_bw) (its transfers could all overlap), and "x its bound" is the
median over repetitions of time per token / bound.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _offload_tools import (  # noqa: E402  (a sibling module of this script)
    Evictor,
    LinkProbe,
    build_model,
    drop_page_cache,
    own_weights,
    pick_threads,
    pinned_h2d_bandwidth,
    ram_bandwidth,
    routing_stats,
    time_engine,
    time_hf,
)

logger = logging.getLogger("bench.offload")
Runner = Callable[[list[int], int], dict[str, Any]]


# ---- contenders -----------------------------------------------------------------------------------
class Bench:
    """Holds the model files and builds each contender's runner."""

    def __init__(self, tmp: Path, args: argparse.Namespace) -> None:
        from freetoken_agents.engine import Engine
        from freetoken_agents.engine.ftw import FTWFile
        from freetoken_agents.engine.loading.convert import convert_checkpoint

        self.args, self.tmp = args, tmp
        self.folder, self.ftw = tmp / "hf", tmp / "model.ftw"
        t0 = time.perf_counter()
        self.shape = build_model(self.folder, args.quick)
        convert_checkpoint(self.folder, self.ftw, quant="fp32", progress=False)
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.ram = Engine.from_pretrained(self.folder, device=args.device)
        own_weights(self.ram.model)
        self.expert_bytes = self.ram.experts.nbytes
        with FTWFile(self.ftw) as f:
            self.stored_block_bytes = max(f.expert_info(*k).block_length for k in f.expert_keys())
        self.build_s = time.perf_counter() - t0
        self.hf: Any = None
        self.hf_layers_on_disk = self.hf_layers_on_cpu = 0

    def tiered(self, placement: str, prefetch: bool, fast: float | None = None) -> Runner:
        from freetoken_agents.engine import Engine, TieringOptions
        from freetoken_agents.engine.memory import MemoryBudget

        kv_room = 8 * self.ram.kv_pool.bytes_per_block
        budget = MemoryBudget(
            fast_bytes=int((self.args.budget if fast is None else fast) * self.expert_bytes) + kv_room,
            host_bytes=int(self.args.host_budget * self.expert_bytes),
        )
        eng = Engine.from_pretrained(
            self.ftw,
            device=self.args.device,
            memory=budget,
            placement=placement,
            tiering=TieringOptions(prefetch=prefetch),
        )
        own_weights(eng.model)
        tp = eng.experts

        def run(prompt: list[int], n: int) -> dict[str, Any]:
            # The link as FreeToken's own reads found it: bytes over the time a read was in flight.
            link = {"link_bytes": lambda: tp.reader.bytes_read, "link_busy_s": lambda: tp.reader.busy_seconds}
            if tp.cuda:  # tier 2 -> tier 1 copies (demand and staged prefetch alike)
                link["h2d_bytes"] = lambda: tp.moves.copies.bytes_copied
            r = time_engine(eng, prompt, n, Evictor([self.ftw]), link)
            st = tp.stats()
            tp.close()
            fast_t, host_t = st["tiers"]["fast"], st["tiers"]["host"]
            pf = st["prefetch"] or {}
            r.update(
                {
                    "fast_hit_rate": fast_t["hits"] / max(1, fast_t["hits"] + fast_t["misses"]),
                    "host_hit_rate": host_t["hits"] / max(1, host_t["hits"] + host_t["misses"]),
                    "decisions": st["policy"]["decisions"],
                    "direct_io": st["tiers"]["storage"]["direct_io"],
                    "prefetch_precision": pf.get("precision"),
                    "prefetch_recall": pf.get("recall"),
                    "prefetch_baseline_precision": pf.get("baseline_precision"),
                    "phase_s": {k: round(v, 3) for k, v in st["phase_s"].items()},
                    "storage_bw_estimate": st["bandwidth"]["storage->host"]["estimate_bps"],
                    "h2d_bw_estimate": st["bandwidth"]["host->fast"]["estimate_bps"] if tp.cuda else None,
                    "file_reads": st["tiers"]["storage"]["reads"],
                    "prefetch": {k: pf[k] for k in ("issued", "taken", "cancelled", "wasted") if k in pf},
                }
            )
            return r

        return run

    def accelerate(self) -> Runner:
        from transformers import AutoModelForCausalLM

        if self.hf is None:  # loaded once: its cold state is the page cache alone
            dense = self.shape["params"] * 4 - self.expert_bytes
            budget, host = self.args.budget * self.expert_bytes, self.args.host_budget * self.expert_bytes
            # The same memory as FreeToken's tiers: dense weights + budget on the GPU and host
            # budget in RAM on CUDA; dense + both budgets in RAM on a CPU-only machine.
            max_memory: dict[Any, int] = {"cpu": int(dense + budget + host)}
            if self.cuda:
                max_memory = {0: int(dense + budget), "cpu": int(host)}
            self.hf = AutoModelForCausalLM.from_pretrained(
                self.folder,
                device_map="auto",
                max_memory=max_memory,
                offload_folder=str(self.tmp / "offload"),
                dtype=torch.float32,
            ).eval()
            own_weights(self.hf)
            self.hf_layers_on_disk = sum(
                1 for k, v in self.hf.hf_device_map.items() if v == "disk" and ".layers." in f".{k}."
            )
            self.hf_layers_on_cpu = sum(
                1 for k, v in self.hf.hf_device_map.items() if v == "cpu" and ".layers." in f".{k}."
            )
        files = [*self.folder.glob("*.safetensors"), *(self.tmp / "offload").glob("*")]
        return lambda prompt, n: time_hf(self.hf, prompt, n, Evictor(files))  # type: ignore[no-any-return]

    def in_ram(self) -> Runner:
        return lambda prompt, n: time_engine(self.ram, prompt, n, Evictor([]))

    def make(self, name: str) -> Runner:
        return {
            "freetoken_qstar": lambda: self.tiered("qstar", True),
            "accelerate_offload": self.accelerate,
            "freetoken_lru": lambda: self.tiered("stream", False),
            "freetoken_ram": self.in_ram,
        }[name]()


CONTENDERS = ("freetoken_qstar", "accelerate_offload", "freetoken_lru", "freetoken_ram")


def cold_run(run: Runner, prompt: list[int], n: int, ref: list[int]) -> dict[str, Any]:
    gc.collect()
    dropped = drop_page_cache()
    r = run(prompt, n)
    r["page_cache_dropped"] = dropped
    r["same_tokens_as_ram"] = r.pop("tokens") == ref
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model (0.2 GB), ~1 min")
    ap.add_argument("--budget", type=float, default=0.25, help="fast-tier fraction of expert bytes")
    ap.add_argument("--host-budget", type=float, default=0.25, help="host-tier fraction of expert bytes")
    ap.add_argument("--tokens", type=int, default=None, help="greedy tokens per timed phase")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (medians are reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: measured best)")
    ap.add_argument("--sweep", action="store_true", help="also run (a) at fast budgets 0.5, 0.75, 1.0")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: tier 1 in GPU memory, tier 2 pinned")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)  # one line per timed phase, so a run cut short still says something
    n = args.tokens or 24
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ft-offload-", dir=os.environ.get("FT_BENCH_DIR")) as tmp:
        b = Bench(Path(tmp), args)
        logger.info("model built and converted in %.0f s on %s", b.build_s, b.device)
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, b.shape["vocab"], (16,), generator=gen).tolist()
        if args.threads:
            torch.set_num_threads(args.threads)
            threads, thread_rates = args.threads, {}
        elif b.cuda:  # the CPU only computes HOST placements: torch's default threads
            threads, thread_rates = torch.get_num_threads(), {}
        else:
            threads, thread_rates = pick_threads(b.ram, prompt)
        ref = time_engine(b.ram, prompt, n, Evictor([]))["tokens"]
        routing = routing_stats(b.ram, prompt, n)
        # The tier 2 -> tier 1 link: a RAM copy on CPU, a pinned host -> device copy on CUDA.
        fast_bw = pinned_h2d_bandwidth(b.device) if b.cuda else ram_bandwidth()
        probe = LinkProbe(Path(tmp), max(b.stored_block_bytes, 1 << 20))
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
        for rep in range(args.reps):
            order = CONTENDERS[rep % len(CONTENDERS) :] + CONTENDERS[: rep % len(CONTENDERS)]
            for name in order:
                run = b.make(name)
                before = probe.measure()
                r = cold_run(run, prompt, n, ref)
                runs[name].append({**r, "link_bw": (before + probe.measure()) / 2})
                last = runs[name][-1]
                logger.info(
                    "rep %d %s: %.2f tok/s, %.0f MB/token from disk, same tokens as (d): %s",
                    rep,
                    name,
                    last["tok_s"],
                    last["disk_bytes_per_token"] / 1e6,
                    last["same_tokens_as_ram"],
                )
        sweep = {}
        if args.sweep:
            for fast in (args.budget, 0.5, 0.75, 1.0):
                sweep[fast] = round(cold_run(b.tiered("qstar", True, fast), prompt, n, ref)["tok_s"], 3)
        summary = report(b, runs, n, threads, thread_rates, fast_bw, load0)
        summary["routing"], summary["qstar_tok_s_by_fast_budget"] = routing, sweep
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(summary, indent=2, default=str))
    res, bound = summary["results"], summary["bound"]
    print(
        f"decode tok/s (median of {args.reps}): "
        + " | ".join(f"{c} {res[c]['tok_s']:.2f}" for c in CONTENDERS)
    )
    print(
        f"ratios: a/b {summary['ratio_a_over_b']:.2f}x  a/c {summary['ratio_a_over_c']:.2f}x  "
        f"a/d {summary['ratio_a_over_d']:.2f}; (a) s/token {1 / res['freetoken_qstar']['tok_s']:.4f} = "
        f"{bound['a_over_bound']:.2f}x its bound (max of disk bytes / link bandwidth and "
        f"{'host->device bytes / pinned copy' if b.cuda else 'touched bytes / RAM'} bandwidth; "
        "median over reps)"
    )
    print(f"a/b in each repetition (contenders back to back): {summary['ratio_a_over_b_by_rep']}")
    if b.cuda:
        est = res["freetoken_qstar"].get("h2d_bw_estimate")
        print(
            f"pinned host->device copy: {fast_bw / 1e9:.1f} GB/s (64 MiB, CUDA events); (a)'s streaming "
            f"copies as its oracle measured them: {(est or 0) / 1e9:.1f} GB/s; (a) copied "
            f"{res['freetoken_qstar'].get('h2d_bytes_per_token', 0) / 1e6:.0f} MB host->device per token"
        )
    print(
        "disk MB read per decode token (/proc/self/io): "
        + " | ".join(f"{c} {res[c]['disk_bytes_per_token'] / 1e6:.0f}" for c in CONTENDERS)
    )
    print(
        "(a) link as its own reads found it (bytes / time with a read in flight), GB/s: "
        + ", ".join(f"{x / 1e9:.2f}" for x in res["freetoken_qstar"]["link_bw_own_reads_Bps_all"])
        + "; probe before/after each phase, GB/s: "
        + ", ".join(f"{x / 1e9:.2f}" for x in res["freetoken_qstar"]["link_bw_probe_Bps_all"])
    )
    if sweep:
        print(
            "(a) tok/s by fast budget (host fixed): "
            + ", ".join(f"{k:g}: {v:.2f}" for k, v in sweep.items())
            + f"; (d) {res['freetoken_ram']['tok_s']:.2f}"
        )
    return 0


def report(
    b: Bench,
    runs: dict[str, list[dict[str, Any]]],
    n: int,
    threads: int,
    thread_rates: dict[int, float],
    fast_bw: float,
    load0: tuple[float, float, float],
) -> dict[str, Any]:
    """Medians, ratios and bounds as one JSON-able dict."""
    sh = b.shape
    touched = sh["top_k"] * b.expert_bytes // sh["experts"]
    res: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        # Per repetition: the disk floor = disk bytes per token / link bandwidth. The link as the
        # probe found it just before and after the phase, and (FreeToken) as its own reads found it
        # during the phase: bytes over the time a read was in flight.
        probe_floors = [r["disk_bytes_per_token"] / r["link_bw"] for r in rs]
        own = [
            r["link_bytes_per_token"] / r["link_busy_s_per_token"]
            for r in rs
            if r.get("link_busy_s_per_token")
        ]
        floors = probe_floors
        if own:
            floors = [r["disk_bytes_per_token"] / bw for r, bw in zip(rs, own, strict=True)]
        # The fast link's floor: the bytes FreeToken copied host -> device per token (CUDA), else
        # the bytes of the experts a token touches, at the link's measured best.
        fast_floors = [r.get("h2d_bytes_per_token", touched) / fast_bw for r in rs]
        over = [(1 / r["tok_s"]) / max(f, ff) for r, f, ff in zip(rs, floors, fast_floors, strict=True)]
        res[name] = {
            "tok_s": statistics.median(r["tok_s"] for r in rs),
            "tok_s_all": [round(r["tok_s"], 3) for r in rs],
            "prefill_s": round(statistics.median(r["prefill_s"] for r in rs), 3),
            "evict_s_median": round(statistics.median(r["evict_s"] for r in rs), 4),
            "page_cache_dropped_every_rep": all(r["page_cache_dropped"] for r in rs),
            "same_tokens_as_ram": all(r["same_tokens_as_ram"] for r in rs),
            "link_bw_probe_Bps_all": [round(r["link_bw"]) for r in rs],
            "link_bw_own_reads_Bps_all": [round(x) for x in own],
            "disk_floor_s_per_token_probe": round(statistics.median(probe_floors), 4),
            "disk_floor_s_per_token": round(statistics.median(floors), 4),
            "s_per_token_over_bound": round(statistics.median(over), 3),
            "fast_link_floor_s_per_token": round(statistics.median(fast_floors), 4),
        }
        for k in (
            "fast_hit_rate",
            "host_hit_rate",
            "prefetch_precision",
            "prefetch_recall",
            "prefetch_baseline_precision",
            "disk_bytes_per_token",
            "h2d_bytes_per_token",
            "h2d_bw_estimate",
        ):
            if rs[0].get(k) is not None:
                res[name][k] = round(statistics.median(r[k] for r in rs), 3)
        for k in ("decisions", "phase_s", "direct_io", "prefetch", "file_reads"):
            if k in rs[-1]:
                res[name][f"{k}_last_rep"] = rs[-1][k]
    res["accelerate_offload"]["decoder_layers_on_disk"] = b.hf_layers_on_disk
    res["accelerate_offload"]["decoder_layers_on_cpu"] = b.hf_layers_on_cpu
    a = res["freetoken_qstar"]
    return {
        "model": {**sh, "expert_bytes": b.expert_bytes, "build_s": round(b.build_s, 1)},
        "device": str(b.device),
        "budget_fraction": b.args.budget,
        "host_budget_fraction": b.args.host_budget,
        "decode_tokens": n - 1,
        "reps": b.args.reps,
        "threads": threads,
        "decode_tok_s_by_threads_on_d": thread_rates,
        "loadavg_at_start": load0,
        "loadavg_at_end": os.getloadavg(),
        "results": res,
        "ratio_a_over_b": a["tok_s"] / res["accelerate_offload"]["tok_s"],
        "ratio_a_over_c": a["tok_s"] / res["freetoken_lru"]["tok_s"],
        "ratio_a_over_d": a["tok_s"] / res["freetoken_ram"]["tok_s"],
        # Each repetition runs every contender back to back: its ratios share one stretch of the
        # link's drift, so their spread shows how much of a ratio is the link, not the design.
        "ratio_a_over_b_by_rep": [
            round(x / y, 2)
            for x, y in zip(a["tok_s_all"], res["accelerate_offload"]["tok_s_all"], strict=True)
        ],
        "bound": {
            "touched_bytes_per_token": touched,
            "fast_link": "pinned host->device copy" if b.cuda else "RAM copy",
            "fast_link_bw_Bps": fast_bw,
            "ram_s_per_token": touched / fast_bw,
            "a_fast_link_floor_s_per_token": a["fast_link_floor_s_per_token"],
            "a_streaming_bw_over_fast_link_bw": (
                a["h2d_bw_estimate"] / fast_bw if a.get("h2d_bw_estimate") else None
            ),
            "a_disk_bytes_per_token": a["disk_bytes_per_token"],
            "a_link_bw_own_reads_Bps_median": statistics.median(a["link_bw_own_reads_Bps_all"]),
            "a_link_bw_probe_Bps_median": statistics.median(a["link_bw_probe_Bps_all"]),
            "a_disk_floor_s_per_token": a["disk_floor_s_per_token"],
            "a_bound_s_per_token": max(a["disk_floor_s_per_token"], a["fast_link_floor_s_per_token"]),
            "a_over_bound": a["s_per_token_over_bound"],
        },
    }


if __name__ == "__main__":
    sys.exit(main())
