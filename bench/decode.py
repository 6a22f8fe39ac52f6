"""Decode and prefill speed of the FreeToken engine vs transformers (eager experts), same weights.

    python bench/decode.py [--quick] [--threads N]

Builds a Mixtral-shaped model with random weights (~1.1 GB in fp32; --quick: ~0.3 GB), saves
it, loads it into transformers (fp32, eager experts) and into FreeToken engines, and times them
side by side in one run, round-robin per repetition: prefill of a 256-token prompt and greedy
decode. Prints medians and the FreeToken/transformers ratios.

Contenders (`Engine.from_pretrained` options):
  fp32                       the default engine (all weights fp32)
  int8 experts               expert_quant="int8": routed experts int8 + per-row fp32 scales
  int8 experts+lm_head       also dense_quant=("lm_head",)
  int8 experts+attn+lm_head  also dense_quant=("attention", "lm_head")
Int8 weights run decode through torch._weight_int8pack_mm (bf16 activations) and prefill by
dequantizing per row block (engine/int8.py).

It also prints, per contender, the weight bytes one decode token reads and the bound that puts
on decode at the RAM read bandwidth measured here, and the int8 engines' logit error against
the fp32 engine (itself checked against transformers): max |diff| / max |logit| over the prefill
and over teacher-forced decode steps, and greedy-token agreement on those steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from freetoken_agents.engine import Engine
from freetoken_agents.engine.moe import MoEBlock

SIZES = {
    "full": dict(
        hidden_size=1024,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    "quick": dict(
        hidden_size=512,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=16000,
    ),
}
CONTENDERS = {  # name -> (Engine.from_pretrained options, which weights are int8)
    "FreeToken fp32": ({}, "none"),
    "FreeToken int8 experts": ({"expert_quant": "int8"}, "experts"),
    "FreeToken int8 experts+lm_head": (
        {"expert_quant": "int8", "dense_quant": ("lm_head",)},
        "experts, lm_head",
    ),
    "FreeToken int8 experts+attn+lm_head": (
        {"expert_quant": "int8", "dense_quant": ("attention", "lm_head")},
        "experts, attention, lm_head",
    ),
}
REFERENCE = "FreeToken fp32"


def build(folder: Path, size: str) -> int:
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
        for p in model.parameters():
            p.normal_(0, 0.02)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def median_time(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def round_robin(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each fn, one call of each per repetition so noise hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def ram_read_bandwidth(reps: int = 5) -> float:
    """Bytes/s of summing a 512 MiB fp32 tensor (median), what a memory-bound GEMV can stream."""
    x = torch.ones(128 << 20)
    x.sum()
    return x.numel() * 4 / median_time(x.sum, reps)


def _nbytes(tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)  # type: ignore[attr-defined]


def decode_bytes(engine: Engine) -> dict[str, int]:
    """Weight bytes one decode token reads, by part: top-k routed experts per MoE layer (mean
    expert size), attention, lm_head, other (norms, routers, one embedding row)."""
    model = engine.model
    out = {"experts": 0, "attention": 0, "lm_head": 0, "other": 0}
    for i, layer in enumerate(model.layers):
        out["attention"] += _nbytes([*layer.self_attn.parameters(), *layer.self_attn.buffers()])
        mlp = layer.mlp
        if isinstance(mlp, MoEBlock):
            sizes = [engine.experts.get(i, e).nbytes for e in range(mlp.spec.num_experts)]
            out["experts"] += mlp.spec.top_k * sum(sizes) // len(sizes)
            out["other"] += _nbytes(mlp.router.parameters())
        else:
            out["other"] += _nbytes(mlp.parameters())
        out["other"] += _nbytes([layer.input_layernorm.weight, layer.post_attention_layernorm.weight])
    head = getattr(model, "lm_head", None)
    emb = model.embed_tokens.weight
    out["lm_head"] = _nbytes([*head.parameters(), *head.buffers()]) if head is not None else _nbytes([emb])
    out["other"] += emb[0].numel() * emb.element_size() + _nbytes([model.norm.weight])
    return out


def _errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per position: max |got - want| / max |want| over the whole of `want` (the logit scale)."""
    return (got - want).abs().amax(-1) / want.abs().max()


def logit_errors(
    engine: Engine, ref: Engine, prompt: list[int], short: list[int], n: int
) -> dict[str, float]:
    """`engine` vs `ref`: prefill logits over `prompt`, and teacher-forced decode logits over
    ref's greedy continuation of `short` (both see the same tokens at every step)."""
    with ref.new_session() as s:
        want_prefill = s.prefill(prompt)
    with engine.new_session() as s:
        got_prefill = s.prefill(prompt)
    with ref.new_session() as s:
        logits = [s.prefill(short, last_only=True)[-1]]
        tokens = []
        for _ in range(n):
            tokens.append(int(logits[-1].argmax()))
            logits.append(s.decode(tokens[-1]))
    want = torch.stack(logits[:n])  # [n, V]: the logits each greedy token was chosen from
    with engine.new_session() as s:
        got_steps = [s.prefill(short, last_only=True)[-1]]
        got_steps += [s.decode(t) for t in tokens[: n - 1]]
    got = torch.stack(got_steps)
    free = engine.generate(short, max_new_tokens=n, stop_token_ids=()).token_ids
    same = next((i for i, (a, b) in enumerate(zip(free, tokens, strict=False)) if a != b), n)
    prefill_err, decode_err = _errors(got_prefill, want_prefill), _errors(got, want)
    return {
        "prefill_err": float(prefill_err.max()),
        "prefill_median": float(prefill_err.median()),
        "decode_err": float(decode_err.max()),
        "decode_median": float(decode_err.median()),
        "agree": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
        "free_run_same": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer repetitions")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    size = "quick" if args.quick else "full"
    reps = args.reps or (3 if args.quick else 5)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    load = os.getloadavg()[0]  # before this script's own work raises it
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        params = build(folder, size)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, experts_implementation="eager"
        ).eval()
        engines = {name: Engine.from_pretrained(folder, **opts) for name, (opts, _) in CONTENDERS.items()}
    engine = engines[REFERENCE]
    threads, cpus = torch.get_num_threads(), os.cpu_count() or 1
    print(
        f"model: Mixtral-shaped, {params / 1e6:.0f} M params ({params * 4 / 2**30:.2f} GiB fp32), "
        f"torch threads {threads}, {cpus} CPUs, 1-min load average at start {load:.1f}"
    )
    if threads > 1 and load > 0.5:
        print(
            f"WARNING: other processes are running (load {load:.1f}); with {threads} threads each parallel "
            "op waits for its slowest thread, so timings are noisy; --threads 1 is steadier"
        )
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, SIZES[size]["vocab_size"], (256,), generator=g)
    short = prompt[:16]
    n = args.decode_tokens

    def hf_prefill():
        hf(prompt[None], use_cache=True)

    def hf_decode():
        hf.generate(
            short[None],
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )

    prefills: dict[str, Callable[[], object]] = {"transformers": hf_prefill}
    shorts: dict[str, Callable[[], object]] = {"transformers": lambda: hf(short[None], use_cache=True)}
    decodes: dict[str, Callable[[], object]] = {"transformers": hf_decode}
    for name, e in engines.items():
        prefills[name] = lambda e=e: ft_prefill(e, prompt)
        shorts[name] = lambda e=e: ft_prefill(e, short)
        decodes[name] = lambda e=e: e.generate(short.tolist(), max_new_tokens=n, stop_token_ids=())
    for fns in (prefills, shorts, decodes):  # warm up everything once
        for fn in fns.values():
            fn()
    prefill_s = round_robin(prefills, reps)
    decode_s = round_robin(decodes, reps)
    short_s = round_robin(shorts, reps)  # decode time excludes the 16-token prefill, per contender
    tps = {name: n / max(decode_s[name] - short_s[name], 1e-9) for name in decodes}

    hf_ms, ft_ms = prefill_s["transformers"] * 1e3, prefill_s[REFERENCE] * 1e3
    print(
        f"prefill 256 tokens: transformers {hf_ms:.0f} ms, freetoken {ft_ms:.0f} ms -> speed ratio "
        f"{hf_ms / ft_ms:.2f}x"
    )
    print(
        f"decode: transformers {tps['transformers']:.1f} tok/s, freetoken {tps[REFERENCE]:.1f} tok/s "
        f"-> ratio {tps[REFERENCE] / tps['transformers']:.2f}x"
    )

    with torch.no_grad():
        hf_logits = hf(prompt[None]).logits[0]
    with engine.new_session() as s:
        ft_logits = s.prefill(prompt.tolist())
    ref_err = float((ft_logits - hf_logits).abs().max() / hf_logits.abs().max())
    print(f"check: FreeToken fp32 vs transformers prefill logits, max|diff|/max|logit| = {ref_err:.1e}")

    bw = ram_read_bandwidth()
    print(f"\nRAM read bandwidth (sum of 512 MiB fp32, median of 5): {bw / 1e9:.1f} GB/s")
    print("weights read per decode token -> bandwidth bound on decode (bytes / bandwidth):")
    for name, e in engines.items():
        parts = decode_bytes(e)
        total = sum(parts.values())
        detail = ", ".join(f"{k} {v / 1e6:.0f}" for k, v in parts.items())
        print(f"  {name:<36} {total / 1e6:5.0f} MB ({detail}) -> at most {bw / total:5.1f} tok/s")
    print(f"  2x transformers needs {2 * tps['transformers']:.1f} tok/s")

    print(
        f"\n{'contender':<36} {'int8 weights':<28} {'prefill ms':>10} {'x':>5} {'decode tok/s':>12} "
        f"{'x':>5}   logit error vs fp32: max over positions (median) prefill / decode; greedy agreement"
    )
    hf_tps = tps["transformers"]
    print(table_row("transformers eager fp32", "none", hf_ms, hf_ms, hf_tps, hf_tps, ""))
    for name, (_, int8_parts) in CONTENDERS.items():
        tail = "(reference)"
        if name != REFERENCE:
            err = logit_errors(engines[name], engine, prompt.tolist(), short.tolist(), n)
            tail = (
                f"{err['prefill_err']:.1e} ({err['prefill_median']:.1e}) / {err['decode_err']:.1e} "
                f"({err['decode_median']:.1e}); teacher-forced {err['agree'] * 100:.0f}% of {n}, "
                f"free-run same first {err['free_run_same']}/{n}"
            )
        print(table_row(name, int8_parts, prefill_s[name] * 1e3, hf_ms, tps[name], hf_tps, tail))
    print(
        f"(x = speed vs transformers, >1 is faster; medians of {reps} round-robin repetitions;\n"
        " logit error at a position = max |diff| / max |logit| of the fp32 engine; large maxima are\n"
        " typically routing flips: a near-tie in a router picks another expert)"
    )


def table_row(name: str, parts: str, ms: float, hf_ms: float, tps: float, hf_tps: float, tail: str) -> str:
    return f"{name:<36} {parts:<28} {ms:10.0f} {hf_ms / ms:5.2f} {tps:12.1f} {tps / hf_tps:5.2f}   {tail}"


def ft_prefill(engine: Engine, tokens: torch.Tensor) -> None:
    with engine.new_session() as s:
        s.prefill(tokens.tolist(), last_only=True)


if __name__ == "__main__":
    main()
