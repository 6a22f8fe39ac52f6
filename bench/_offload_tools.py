"""What bench/offload.py and bench/eviction.py measure with: the Mixtral-shaped model, page-cache
control, link probes, the timed decode loop and the routing recorder. Not a benchmark itself
(the leading underscore keeps it out of `freetoken bench`'s list)."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch


def drop_page_cache() -> bool:
    """Drop the OS page cache (needs root); True if it worked."""
    try:
        subprocess.run(["sync"], check=False)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


class Evictor:
    """Drops `files` from the page cache (posix_fadvise DONTNEED); `seconds` spent in it."""

    def __init__(self, files: Sequence[Path]) -> None:
        self.files, self.seconds = list(files), 0.0

    def __call__(self) -> None:
        t0 = time.perf_counter()
        for f in self.files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        self.seconds += time.perf_counter() - t0


def build_model(folder: Path, quick: bool) -> dict[str, int]:
    """Save a random Mixtral-shaped checkpoint into `folder` (unit-std embeddings); its shape."""
    from transformers import MixtralConfig, MixtralForCausalLM

    h, inter, layers, vocab = (512, 1024, 4, 2048) if quick else (1024, 2048, 8, 32000)
    cfg = MixtralConfig(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)  # see the module docstring
    model.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    return {
        "hidden": h,
        "intermediate": inter,
        "layers": layers,
        "experts": 8,
        "top_k": 2,
        "vocab": vocab,
        "params": params,
    }


def own_weights(module: torch.nn.Module) -> None:
    """Copy every materialised parameter/buffer into owned memory (no mmapped file pages), and the
    host copies accelerate keeps for layers it offloads to "cpu" when the model runs on a GPU
    (their parameters are meta; the weights live in the hooks' weights_map)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.device.type != "meta":
                t.data = t.data.clone()
        seen: set[int] = set()
        for m in module.modules():
            loader = getattr(getattr(getattr(m, "_hf_hook", None), "weights_map", None), "dataset", None)
            host = getattr(loader, "state_dict", None)
            if isinstance(host, dict) and id(host) not in seen:
                seen.add(id(host))
                for k, v in host.items():
                    if isinstance(v, torch.Tensor):
                        host[k] = v.clone()


class LinkProbe:
    """The disk link's bandwidth right now: O_DIRECT reads of a scratch file of random bytes, one
    block-sized request at a time, as FreeToken's reader issues them, each into its own buffer
    of the kind that reader uses (huge pages: `new_block_buffer`). Its own buffer, because a
    reader that keeps what it reads (tier 2) cannot land every block in one buffer, and on this
    machine's virtual disk reads into one buffer over and over ran ~1.3x faster (3.4 vs 2.6 GB/s)
    than the same reads into a rotating set: a probe with one buffer measured a link no reader
    holding its blocks gets. No contender reads this file, so measuring warms nothing any of them
    will read; run before every timed phase, since this shared machine's disk drifts (0.3 to
    3.3 GB/s measured within minutes). The buffers are allocated once (and reused by every
    measure, as the reader recycles its buffers)."""

    def __init__(self, folder: Path, block: int, nbytes: int = 384 << 20) -> None:
        from freetoken_agents.engine.memory import new_block_buffer

        self.path, self.block = folder / "link_probe.bin", -(-block // 4096) * 4096
        blocks = max(1, nbytes // self.block)
        with open(self.path, "wb") as f:
            for _ in range(blocks):
                f.write(os.urandom(self.block))
            f.flush()
            os.fsync(f.fileno())
        self.buffers = [new_block_buffer(self.block) for _ in range(blocks)]

    def measure(self) -> float:
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            n = 0
            t0 = time.perf_counter()
            for i, buf in enumerate(self.buffers):
                n += os.preadv(fd, [buf], i * self.block)
            return n / (time.perf_counter() - t0)
        finally:
            os.close(fd)


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


def pinned_h2d_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 64 MiB copy from page-locked host memory to `device` (CUDA events, median of
    10 after 3 warm-ups): the tier 2 -> tier 1 link at its best."""
    src = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(src.shape, dtype=src.dtype, device=device)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return src.numel() / statistics.median(times)


# ---- timing ---------------------------------------------------------------------------------------
def disk_read_bytes() -> int:
    """Bytes this process (all threads) made the kernel read from storage: /proc/self/io
    read_bytes (counts O_DIRECT reads and mmap page faults alike; not page-cache hits)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


Probe = Callable[[], float]


def time_loop(
    step: Callable[[list[int]], int],
    prompt: list[int],
    n: int,
    evict: Evictor,
    probes: dict[str, Probe] | None = None,
) -> dict[str, Any]:
    """Prefill (timed apart), then n-1 greedy decode steps; `evict` after every forward, its time
    taken out. Each probe (a running total; "disk_bytes" = `disk_read_bytes` always) is sampled
    after prefill and at the end: `{name}_per_token` is its growth per decode token."""
    probes = {"disk_bytes": disk_read_bytes, **(probes or {})}
    t0 = time.perf_counter()
    tok = step(prompt)
    evict()
    t1, e1 = time.perf_counter(), evict.seconds
    first = {k: f() for k, f in probes.items()}
    out = [tok]
    for _ in range(n - 1):
        tok = step([tok])
        evict()
        out.append(tok)
    t2, e2 = time.perf_counter(), evict.seconds
    decode_s = (t2 - t1) - (e2 - e1)
    r: dict[str, Any] = {"prefill_s": t1 - t0 - e1, "tok_s": (n - 1) / decode_s, "tokens": out, "evict_s": e2}
    r.update({f"{k}_per_token": (f() - first[k]) / (n - 1) for k, f in probes.items()})
    return r


def time_engine(
    engine: Any, prompt: list[int], n: int, evict: Evictor, probes: dict[str, Probe] | None = None
) -> dict[str, Any]:
    with engine.new_session() as s:

        def step(ids: list[int]) -> int:
            return int(s.prefill(ids, last_only=True)[0].argmax())

        return time_loop(step, prompt, n, evict, probes)


def time_hf(model: Any, prompt: list[int], n: int, evict: Evictor) -> dict[str, Any]:
    from transformers import DynamicCache

    from freetoken_agents.recipes.tiny.forward import cache_argument

    kv = {cache_argument(model): DynamicCache()}  # `cache`, or `past_key_values` before 5.2x

    def step(ids: list[int]) -> int:
        with torch.no_grad():
            out = model(torch.tensor([ids], device=model.device), use_cache=True, **kv)
        return int(out.logits[0, -1].argmax())

    return time_loop(step, prompt, n, evict)


def pick_threads(engine: Any, prompt: list[int]) -> tuple[int, dict[int, float]]:
    """The thread count (1..cpu_count) with the best median decode rate on `engine`."""
    rates: dict[int, float] = {}
    for nt in range(1, (os.cpu_count() or 1) + 1):
        torch.set_num_threads(nt)
        time_engine(engine, prompt[:4], 3, Evictor([]))
        rates[nt] = statistics.median(time_engine(engine, prompt, 8, Evictor([]))["tok_s"] for _ in range(3))
    best = max(rates, key=rates.__getitem__)
    torch.set_num_threads(best)
    return best, rates


Trace = list[list[tuple[int, list[int]]]]  # per forward: (layer, experts used) in layer order


def record_routing(engine: Any, prompt: list[int], n: int) -> Trace:
    """Greedy-decode `n` tokens after `prompt` (the prefill is forward 0); the experts each
    forward routed to, per layer."""
    from freetoken_agents.engine.model.experts import DelegatingStore, run_experts

    inner, trace = engine.experts, []

    class Recorder(DelegatingStore):
        def run(self, layer: int, hidden: Any, ids: Any, w: Any, spec: Any) -> Any:
            trace[-1].append((layer, sorted(set(ids.reshape(-1).tolist()))))
            return run_experts(self.get, layer, hidden, ids, w, spec)

    engine.use_expert_provider(Recorder(inner))
    try:
        with engine.new_session() as s:
            trace.append([])
            tok = int(s.prefill(prompt, last_only=True)[0].argmax())
            for _ in range(n - 1):
                trace.append([])
                tok = int(s.prefill([tok], last_only=True)[0].argmax())
    finally:
        engine.use_expert_provider(inner)
    return trace


def routing_stats(engine: Any, prompt: list[int], n: int) -> dict[str, Any]:
    """Routing of `engine`'s greedy run: how often consecutive decode tokens share an expert in a
    layer, per-layer max/min expert load."""
    trace = record_routing(engine, prompt, n)
    decode = [(layer, used) for fwd in trace[1:] for layer, used in fwd]
    layers = sorted({layer for layer, _ in decode})
    per_layer = {lay: [set(u) for la, u in decode if la == lay] for lay in layers}
    share = [bool(a & b) for seq in per_layer.values() for a, b in zip(seq, seq[1:], strict=False)]
    loads = []
    for seq in per_layer.values():
        counts = [sum(e in u for u in seq) for e in range(8)]
        loads.append(round(max(counts) / max(1, min(counts)), 1))
    return {
        "consecutive_tokens_share_an_expert": round(sum(share) / max(1, len(share)), 3),
        "max_over_min_expert_load_per_layer": loads,
        "decode_tokens": n - 1,
    }
