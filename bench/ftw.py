"""FTW format figures: bytes per parameter, decode throughput and open time per codec, vs baselines.

    python bench/ftw.py            # Mixtral-shaped, 265 MiB fp32 (69 M params), ~40 s on 2 cores
    python bench/ftw.py --quick    # 113 MiB fp32 (30 M params), ~25 s

A Mixtral-shaped model with random weights is built from a config with transformers and saved
(safetensors) to a temporary folder, then converted once per codec with `convert_checkpoint`
(``--quant fp32 | bf16 | fp8 | int8 | mxfp4``). Measured in the same run, per codec:

- ``B/param``: bytes per routed-expert parameter as stored: block headers + stored bytes, and in
  brackets with the 4096-byte alignment padding of each block (what the file really spends).
- ``decode``: GB/s of fp32 output of the codec's decode alone, from the encoded parts in memory,
  over every projection of every expert (median over repetitions). The fp32 codec decodes to a view
  of its stored bytes (no work), so it shows ``view``. Baseline: ``clone`` of fp32 tensors of the
  same shapes (allocation + memcpy of the same output bytes): the ratio says how far each codec
  is from "as fast as copying its output".
- ``read+decode``: GB/s of fp32 output of `FTWFile.decode_expert` for every block: ``pread`` (page
  cache: the files were just written), xxhash64 check, zstd (none here) and decode. Same baseline.
- ``open``: `FTWFile(path)` (fixed header, manifest read, checksummed and parsed, dense region
  mapped) vs safetensors ``safe_open`` + ``keys()`` of the source checkpoint (median of many).
- ``TTFT``: `Engine.from_pretrained(x)` + prefill of a 16-token prompt + argmax (time to first
  token) from each FTW file vs from the source Hugging Face folder (which decodes every expert
  up front; FTW reads only the experts the prompt routes to). Medians over repetitions.

Everything runs warm (page cache), on ``--threads`` torch threads (default 1: on a shared 2-core
machine two OpenMP threads can stall each other; see bench/offload.py).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open

from freetoken_agents.engine import Engine
from freetoken_agents.engine.ftw import EncodedTensor, FTWFile, get_codec
from freetoken_agents.engine.ftw.container import ALIGNMENT
from freetoken_agents.engine.loading.convert import QUANT_CODECS, convert_checkpoint

QUANTS = ("fp32", "bf16", "fp8", "int8", "mxfp4")
SIZES: dict[str, dict[str, int]] = {
    # experts: 4 layers x 8 experts x 3 x 512 x 1024 = 50 M params (~200 MB fp32)
    "full": dict(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=16000,
    ),
    # experts: 4 x 8 x 3 x 384 x 512 = 19 M params (~75 MB fp32)
    "quick": dict(
        hidden_size=384,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=12000,
    ),
}
PROMPT_TOKENS = 16


def build(folder: Path, size: str) -> int:
    """Save a random Mixtral-shaped model (fp32 safetensors) to `folder`; returns its parameter count."""
    config = transformers.MixtralConfig(
        **SIZES[size],
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("gate.weight"):  # routers: decisive routing
                p.normal_(0, 0.3)
            else:
                p.normal_(0, 0.02)
    model.save_pretrained(folder)
    n = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    return n


def interleaved(
    fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 1, collect: bool = False
) -> dict[str, float]:
    """Median wall time of each function; every repetition runs all of them in a rotated order.

    Interleaving makes noise from other processes on a shared machine hit every contender alike,
    so the ratios of the medians are steadier than the medians themselves. ``collect`` runs the
    garbage collector (untimed) before each call, for contenders that free large objects.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            if collect:
                gc.collect()
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def expert_sizes(f: FTWFile) -> tuple[int, int, int]:
    """(routed-expert params, block bytes, block bytes incl. alignment padding)."""
    params = stored = aligned = 0
    for key in f.expert_keys():
        info = f.expert_info(*key)
        for t in info.tensors.values():
            numel = 1
            for s in t.shape:
                numel *= s
            params += numel
        stored += info.block_length
        aligned += -(-info.block_length // ALIGNMENT) * ALIGNMENT
    return params, stored, aligned


def bench_codec(path: Path, source: Path, reps: int) -> dict[str, Any]:
    """Bytes per parameter; decode and read+decode vs clone (GB/s of fp32 output); open vs safe_open."""
    with FTWFile(path) as f:
        params, stored, aligned = expert_sizes(f)
        out_bytes = params * 4
        keys = f.expert_keys()
        encoded: list[EncodedTensor] = [enc for k in keys for enc in f.encoded_expert(*k).values()]
        srcs = [torch.randn(enc.shape) for enc in encoded]  # the clone baseline's inputs

        def decode_all() -> None:
            for enc in encoded:
                get_codec(enc.codec).decode(enc, torch.float32)

        def read_decode_all() -> None:
            for k in keys:
                f.decode_expert(*k)

        def clone_all() -> None:
            for t in srcs:
                t.clone()

        t = interleaved({"decode": decode_all, "read": read_decode_all, "clone": clone_all}, reps)
    shards = sorted(source.glob("*.safetensors"))

    def st_open() -> None:
        for shard in shards:
            with safe_open(shard, framework="pt") as st:
                st.keys()

    o = interleaved({"ftw": lambda: FTWFile(path).close(), "st": st_open}, reps * 20, warmup=3)
    return {
        "params": params,
        "bpp": stored / params,
        "bpp_aligned": aligned / params,
        "decode_gbs": out_bytes / t["decode"] / 1e9,
        "read_gbs": out_bytes / t["read"] / 1e9,
        "clone_gbs": out_bytes / t["clone"] / 1e9,
        "open_s": o["ftw"],
        "st_open_s": o["st"],
        "view": {enc.codec for enc in encoded} == {"fp32"},
    }


def first_token(path: Path, prompt: list[int], loaded: dict[str, int]) -> Callable[[], None]:
    """A function running `Engine.from_pretrained(path)` + prefill of `prompt` + argmax.

    For an FTW file it records in ``loaded[path.stem]`` how many expert blocks that read.
    """

    def run() -> None:
        engine = Engine.from_pretrained(path)
        with engine.new_session() as s:
            int(s.prefill(prompt, last_only=True)[0].argmax())
        n = getattr(engine.experts, "experts_loaded", None)
        if n is not None:
            loaded[path.stem] = n

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer repetitions")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per measurement")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    size = "quick" if args.quick else "full"
    reps = args.reps or (3 if args.quick else 5)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-ftw-") as tmp:
        folder = Path(tmp) / "hf"
        params = build(folder, size)
        src_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        cfg = SIZES[size]
        print(
            f"model: Mixtral-shaped {size}, {params / 1e6:.1f} M params ({src_bytes / 2**20:.0f} MiB fp32 "
            f"safetensors), hidden {cfg['hidden_size']}, expert intermediate {cfg['intermediate_size']}, "
            f"{cfg['num_hidden_layers']} layers x 8 experts; torch threads {torch.get_num_threads()}, "
            f"{reps} reps"
        )
        paths: dict[str, Path] = {}
        for quant in QUANTS:
            t0 = time.perf_counter()
            paths[quant] = Path(tmp) / f"{quant}.ftw"
            convert_checkpoint(folder, paths[quant], quant=quant, progress=False)
            print(f"  converted {quant:5s} in {time.perf_counter() - t0:5.1f}s", flush=True)

        results = {quant: bench_codec(paths[quant], folder, reps) for quant in QUANTS}
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, cfg["vocab_size"], (PROMPT_TOKENS,), generator=g).tolist()
        loaded: dict[str, int] = {}
        contenders = {"hf": first_token(folder, prompt, loaded)}
        contenders |= {quant: first_token(paths[quant], prompt, loaded) for quant in QUANTS}
        ttft = interleaved(contenders, reps, collect=True)

    expert_params = results["fp32"]["params"]
    n_blocks = cfg["num_hidden_layers"] * 8
    clone = statistics.median(r["clone_gbs"] for r in results.values())
    st_open = statistics.median(r["st_open_s"] for r in results.values())
    print(f"\nexperts: {expert_params / 1e6:.1f} M params; baselines measured in this run (medians):")
    print(f"  clone (alloc + memcpy) of fp32 tensors of the experts' shapes: {clone:.2f} GB/s")
    print(f"  safetensors safe_open + keys() of the source checkpoint: {st_open * 1e3:.3f} ms")
    print(
        f"  Engine.from_pretrained(HF folder) + first token: {ttft['hf']:.3f} s (decodes all "
        f"{n_blocks} experts up front; from FTW the {PROMPT_TOKENS}-token prompt read "
        f"{min(loaded.values())}-{max(loaded.values())} of them)"
    )
    head = (
        f"\n{'codec':8s} {'B/param (aligned)':>18s} {'decode GB/s':>12s} {'x clone':>8s} "
        f"{'read+dec GB/s':>14s} {'x clone':>8s} {'open ms':>8s} {'x s.t.':>7s} "
        f"{'TTFT s':>7s} {'x HF':>6s}"
    )
    print(head)
    print("-" * (len(head) - 1))
    for quant in QUANTS:
        r = results[quant]
        codec = QUANT_CODECS[quant]
        dec = "view" if r["view"] else f"{r['decode_gbs']:.2f}"
        dec_x = "-" if r["view"] else f"{r['decode_gbs'] / r['clone_gbs']:.2f}"
        print(
            f"{codec:8s} {r['bpp']:>7.4f} ({r['bpp_aligned']:.4f}) {dec:>12s} {dec_x:>8s} "
            f"{r['read_gbs']:>14.2f} {r['read_gbs'] / r['clone_gbs']:>8.2f} {r['open_s'] * 1e3:>8.3f} "
            f"{r['open_s'] / r['st_open_s']:>7.2f} {ttft[quant]:>7.3f} {ttft[quant] / ttft['hf']:>6.2f}"
        )
    print(
        "\nx clone: throughput / clone throughput measured interleaved with it (1.0 = as fast as "
        "copying the output); x s.t.: FTW open time / safetensors safe_open time (interleaved); "
        "x HF: TTFT / TTFT from the HF folder (interleaved). Lower is better for the last two. "
        f"Total bench time {time.perf_counter() - t_start:.0f}s."
    )


if __name__ == "__main__":
    main()
