"""Decode and prefill speed of the FreeToken engine vs transformers (eager experts) and llama.cpp,
same weights, at a short and a long context.

    python bench/decode.py [--quick] [--threads N] [--llama-convert PATH] [--baseline-tree DIR]

Builds a Mixtral-shaped model with random weights (~1.1 GB in fp32; --quick: ~0.3 GB), saves
it, loads it into transformers (fp32, eager experts), into FreeToken engines and (when
`llama_cpp` imports and its converter is given, see bench/_decode_peers.py) into llama.cpp via
its own f32 GGUF converter, and times them side by side in one run, round-robin per repetition:
prefill of a 256-token prompt, and decode at two contexts (`--contexts`, default 64 and 4000
tokens): each repetition decodes `--decode-tokens` teacher-forced tokens after the context and
then truncates back to it; the rate is tokens / seconds of those decode calls alone (timed
around them, never a difference of two timings). Prints medians and ratios.

Contenders (`Engine.from_pretrained` options):
  fp32                       the default engine (all weights fp32)
  int8 experts               expert_quant="int8": routed experts int8 + per-row fp32 scales
  int8 experts+lm_head       also dense_quant=("lm_head",)
  int8 experts+attn+lm_head  also dense_quant=("attention", "lm_head")
  fp32 (baseline tree)       with --baseline-tree DIR: the engine of another checkout (e.g.
                             `git worktree add DIR <commit>`), the "before" of a change
Int8 weights run decode through torch._weight_int8pack_mm (bf16 activations) and prefill by
dequantizing per row block (engine/kernels/int8.py). llama.cpp runs with an f32 KV cache (the same
bytes as FreeToken's) and the same threads.

It also prints, per contender, the weight bytes one decode token reads and the bound that puts
on decode at the RAM read bandwidth measured here, and the int8 engines' logit error against
the fp32 engine (itself checked against transformers): max |diff| / max |logit| over the prefill
and over teacher-forced decode steps, and greedy-token agreement on those steps.
Targets (issue 24): FreeToken fp32 decode >= 0.6x llama.cpp; decode at the long context >= 0.7x
decode at the short one.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from _decode_peers import llama_cpp_peer, llama_logits, load_engine_module, write_llama_tokenizer

from freetoken_agents.engine import Engine
from freetoken_agents.engine.model.moe import MoEBlock
from freetoken_agents.recipes.tiny.forward import cache_argument

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
MAX_POSITIONS = 4096
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
BASELINE = "FreeToken fp32 (baseline tree)"


def build(folder: Path, size: str) -> int:
    config = transformers.MixtralConfig(
        **SIZES[size],
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=MAX_POSITIONS,
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
        if type(mlp).__name__ == MoEBlock.__name__:  # also a --baseline-tree engine's class
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


class EngineDecoder:
    """Decode timing for a FreeToken engine: one session holds the context."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.session, self.context = engine, None, 0

    def prepare(self, prompt: list[int]) -> None:
        self.close()
        self.session = self.engine.new_session()
        self.session.prefill(prompt, last_only=True)
        self.context = len(prompt)

    def run(self, tokens: list[int]) -> float:
        t0 = time.perf_counter()
        for t in tokens:
            self.session.decode(t)
        took = time.perf_counter() - t0
        self.session.truncate(self.context)
        return took

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


class HFDecoder:
    """Decode timing for transformers: a DynamicCache holds the context, cropped back after."""

    def __init__(self, model: Any) -> None:
        self.model, self.cache, self.context = model, None, 0
        self.cache_arg = cache_argument(model)

    def prepare(self, prompt: list[int]) -> None:
        out = self.model(torch.tensor([prompt]), use_cache=True)
        self.cache = out.get("cache") or out.get("past_key_values")
        self.context = len(prompt)

    def run(self, tokens: list[int]) -> float:
        t0 = time.perf_counter()
        for t in tokens:
            self.model(torch.tensor([[t]]), use_cache=True, **{self.cache_arg: self.cache})
        took = time.perf_counter() - t0
        crop_to(self.cache, self.context)
        return took

    def close(self) -> None:
        self.cache = None


def crop_to(cache: Any, length: int) -> None:
    """Cut a transformers cache back to `length` tokens: `crop(n)` keeps n tokens up to
    transformers 5.2x, later releases take minus the number of tokens to remove."""
    if "tokens_to_remove" in inspect.signature(cache.crop).parameters:
        cache.crop(length - cache.get_seq_length())
    else:
        cache.crop(length)


class LlamaDecoder:
    """Decode timing for llama.cpp: its context holds the KV; `n_tokens` rolls it back."""

    def __init__(self, llm: Any) -> None:
        self.llm, self.context = llm, 0

    def prepare(self, prompt: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(prompt)
        self.context = len(prompt)

    def run(self, tokens: list[int]) -> float:
        t0 = time.perf_counter()
        for t in tokens:
            self.llm.eval([t])
        took = time.perf_counter() - t0
        self.llm.n_tokens = self.context  # the next eval drops the KV past it
        return took

    def close(self) -> None:
        self.llm.reset()


def rate(tokens: int, seconds: Sequence[float]) -> float:
    """Tokens per second from the median of measured intervals (each around real work)."""
    mid = statistics.median(seconds)
    if mid <= 0:
        raise RuntimeError(f"a decode interval of {mid} s cannot be timed; the clock did not advance")
    return tokens / mid


def decode_rates(
    decoders: dict[str, Any], prompt: list[int], tokens: list[int], reps: int
) -> dict[str, float]:
    """tok/s per contender after `prompt`, repetitions round-robin (noise hits all alike)."""
    for d in decoders.values():
        d.prepare(prompt)
        d.run(tokens[:2])  # warm up at this context
    times: dict[str, list[float]] = {name: [] for name in decoders}
    for _ in range(reps):
        for name, d in decoders.items():
            times[name].append(d.run(tokens))
    for d in decoders.values():
        d.close()
    return {name: rate(len(tokens), ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer repetitions")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--contexts", default="64,4000", help="decode contexts in tokens, comma-separated")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch and llama.cpp threads")
    parser.add_argument("--no-int8", action="store_true", help="only the fp32 FreeToken engine")
    parser.add_argument("--llama-convert", default=None, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--baseline-tree", type=Path, default=None, help="another checkout's engine too")
    args = parser.parse_args()
    size = "quick" if args.quick else "full"
    reps = args.reps or (3 if args.quick else 5)
    n = args.decode_tokens
    contexts = [int(c) for c in args.contexts.split(",")]
    if max(contexts) + n + 1 > MAX_POSITIONS:
        raise SystemExit(
            f"--contexts: {max(contexts)} + {n} decode tokens exceed the model's {MAX_POSITIONS}"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    load = os.getloadavg()[0]  # before this script's own work raises it
    contenders = {REFERENCE: CONTENDERS[REFERENCE]} if args.no_int8 else CONTENDERS
    threads, cpus = torch.get_num_threads(), os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        params = build(folder, size)
        write_llama_tokenizer(folder, SIZES[size]["vocab_size"])
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, experts_implementation="eager"
        ).eval()
        engines = {name: Engine.from_pretrained(folder, **opts) for name, (opts, _) in contenders.items()}
        if args.baseline_tree is not None:
            engines[BASELINE] = load_engine_module(args.baseline_tree).Engine.from_pretrained(folder)
        llm, llama_note = llama_cpp_peer(folder, args.llama_convert, threads, MAX_POSITIONS)
    engine = engines[REFERENCE]
    print(
        f"model: Mixtral-shaped, {params / 1e6:.0f} M params ({params * 4 / 2**30:.2f} GiB fp32), "
        f"torch threads {threads}, {cpus} CPUs, 1-min load average at start {load:.1f}"
    )
    if threads > 1 and load > 0.5:
        print(
            f"WARNING: other processes are running (load {load:.1f}); with {threads} threads each parallel "
            "op waits for its slowest thread, so timings are noisy; --threads 1 is steadier"
        )
    print(
        llama_note or f"llama.cpp: llama-cpp-python, f32 GGUF from convert_hf_to_gguf.py, {threads} threads"
    )
    g = torch.Generator().manual_seed(1)
    vocab = SIZES[size]["vocab_size"]
    prompt = torch.randint(0, vocab, (max(256, *contexts),), generator=g).tolist()
    forced = torch.randint(0, vocab, (n,), generator=g).tolist()  # teacher-forced decode tokens

    prefills: dict[str, Callable[[], object]] = {"transformers": lambda: hf(torch.tensor([prompt[:256]]))}
    for name, e in engines.items():
        prefills[name] = lambda e=e: ft_prefill(e, prompt[:256])
    decoders: dict[str, Any] = {"transformers": HFDecoder(hf)}
    decoders.update({name: EngineDecoder(e) for name, e in engines.items()})
    if llm is not None:
        prefills["llama.cpp"] = lambda: llama_logits(llm, prompt[:256])
        decoders["llama.cpp"] = LlamaDecoder(llm)
    for fn in prefills.values():  # warm up
        fn()
    prefill_s = round_robin(prefills, reps)
    tps = {c: decode_rates(decoders, prompt[:c], forced, reps) for c in contexts}

    with torch.no_grad():
        hf_logits = hf(torch.tensor([prompt[:256]])).logits[0]
    with engine.new_session() as s:
        ft_logits = s.prefill(prompt[:256])
    ref_err = float((ft_logits - hf_logits).abs().max() / hf_logits.abs().max())
    print(f"check: FreeToken fp32 vs transformers prefill logits, max|diff|/max|logit| = {ref_err:.1e}")
    if llm is not None:
        lc = torch.from_numpy(llama_logits(llm, prompt[:64]))
        lc_err = float((lc - ft_logits[:64]).abs().max() / ft_logits[:64].abs().max())
        print(
            f"check: llama.cpp vs FreeToken fp32 prefill logits (64 tokens), max|diff|/max|logit| = "
            f"{lc_err:.1e}"
        )

    short, long = min(contexts), max(contexts)
    print(
        f"\nprefill 256 tokens (ms) and decode ({n} tokens, tok/s) after "
        f"{', '.join(map(str, contexts))} tokens:"
    )
    names = list(prefills)
    header = f"{'contender':<36} {'prefill ms':>10} " + " ".join(f"{'@' + str(c):>9}" for c in contexts)
    print(header + f" {'long/short':>10}")
    for name in names:
        cells = " ".join(f"{tps[c][name]:9.1f}" for c in contexts)
        print(f"{name:<36} {prefill_s[name] * 1e3:10.0f} {cells} {tps[long][name] / tps[short][name]:10.2f}")
    for c in contexts:
        ft = tps[c][REFERENCE]
        parts = [f"vs transformers {ft / tps[c]['transformers']:.2f}x"]
        if llm is not None:
            parts.append(f"vs llama.cpp {ft / tps[c]['llama.cpp']:.2f}x (target >= 0.6)")
        if BASELINE in engines:
            parts.append(f"vs the baseline tree {ft / tps[c][BASELINE]:.2f}x")
        print(f"FreeToken fp32 decode @{c}: {ft:.1f} tok/s, " + ", ".join(parts))
    print(
        f"FreeToken fp32 decode @{long} / @{short}: {tps[long][REFERENCE] / tps[short][REFERENCE]:.2f} "
        "(target >= 0.7); prefill vs transformers "
        f"{prefill_s['transformers'] / prefill_s[REFERENCE]:.2f}x"
        + (
            f", vs the baseline tree {prefill_s[BASELINE] / prefill_s[REFERENCE]:.2f}x"
            if BASELINE in engines
            else ""
        )
    )

    bw = ram_read_bandwidth()
    print(f"\nRAM read bandwidth (sum of 512 MiB fp32, median of 5): {bw / 1e9:.1f} GB/s")
    print("weights read per decode token -> bandwidth bound on decode (bytes / bandwidth):")
    for name, e in engines.items():
        parts = decode_bytes(e)
        total = sum(parts.values())
        detail = ", ".join(f"{k} {v / 1e6:.0f}" for k, v in parts.items())
        print(f"  {name:<36} {total / 1e6:5.0f} MB ({detail}) -> at most {bw / total:5.1f} tok/s")

    if len(contenders) > 1:
        print(
            f"\n{'int8 contender':<36} {'int8 weights':<28} logit error vs fp32: max over positions "
            "(median) prefill / decode; greedy agreement"
        )
        for name, (_, int8_parts) in contenders.items():
            if name == REFERENCE:
                continue
            err = logit_errors(engines[name], engine, prompt[:256], prompt[:16], n)
            print(
                f"{name:<36} {int8_parts:<28} {err['prefill_err']:.1e} ({err['prefill_median']:.1e}) / "
                f"{err['decode_err']:.1e} ({err['decode_median']:.1e}); teacher-forced "
                f"{err['agree'] * 100:.0f}% of {n}, free-run same first {err['free_run_same']}/{n}"
            )
    print(
        f"(medians of {reps} round-robin repetitions; logit error at a position = max |diff| / max |logit|\n"
        " of the fp32 engine; large maxima are typically routing flips: a near-tie in a router picks\n"
        " another expert)"
    )


def ft_prefill(engine: Engine, tokens: list[int]) -> None:
    with engine.new_session() as s:
        s.prefill(tokens, last_only=True)


if __name__ == "__main__":
    main()
