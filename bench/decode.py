"""Decode and prefill speed of the FreeToken engine vs transformers (eager experts), same weights.

    python bench/decode.py [--quick]

Builds a Mixtral-shaped model with random weights (~1.1 GB in fp32; --quick: ~0.3 GB), saves
it, loads it into both, and times them side by side in one run: prefill of a 256-token prompt
and greedy decode. Prints medians over repetitions and the engine/transformers ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from freetoken_agents.engine import Engine

SIZES = {
    "full": dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000),
    "quick": dict(hidden_size=512, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=16000),
}


def build(folder: Path, size: str) -> int:
    config = transformers.MixtralConfig(
        **SIZES[size], num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
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


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer repetitions")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    size = "quick" if args.quick else "full"
    reps = args.reps or (3 if args.quick else 5)
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        params = build(folder, size)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, experts_implementation="eager"
        ).eval()
        engine = Engine.from_pretrained(folder)
    print(f"model: Mixtral-shaped, {params / 1e6:.0f} M params ({params * 4 / 2**30:.2f} GiB fp32), "
          f"torch threads {torch.get_num_threads()}")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, SIZES[size]["vocab_size"], (256,), generator=g)
    short = prompt[:16]
    n = args.decode_tokens

    def hf_prefill():
        hf(prompt[None], use_cache=True)

    def ft_prefill():
        with engine.new_session() as s:
            s.prefill(prompt.tolist(), last_only=True)

    def hf_decode():
        hf.generate(short[None], do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                    pad_token_id=0)

    def ft_decode():
        engine.generate(short.tolist(), max_new_tokens=n, stop_token_ids=())

    # Warm up both, then interleave the measurements so machine noise hits both alike.
    for fn in (hf_prefill, ft_prefill, hf_decode, ft_decode):
        fn()
    results = {}
    for name, fn in (("hf_prefill", hf_prefill), ("ft_prefill", ft_prefill)):
        results[name] = median_time(fn, reps)
    for name, fn in (("hf_decode", hf_decode), ("ft_decode", ft_decode)):
        results[name] = median_time(fn, reps)
    # Decode time excludes the 16-token prefill, measured separately for each side.
    hf_short = median_time(lambda: hf(short[None], use_cache=True), reps)
    ft_short = median_time(lambda: ft_prefill_short(engine, short), reps)
    hf_tps = n / max(results["hf_decode"] - hf_short, 1e-9)
    ft_tps = n / max(results["ft_decode"] - ft_short, 1e-9)
    print(f"prefill 256 tokens: transformers {results['hf_prefill'] * 1e3:.0f} ms, "
          f"freetoken {results['ft_prefill'] * 1e3:.0f} ms -> speed ratio "
          f"{results['hf_prefill'] / results['ft_prefill']:.2f}x")
    print(f"decode: transformers {hf_tps:.1f} tok/s, freetoken {ft_tps:.1f} tok/s "
          f"-> ratio {ft_tps / hf_tps:.2f}x")


def ft_prefill_short(engine: Engine, short: torch.Tensor) -> None:
    with engine.new_session() as s:
        s.prefill(short.tolist(), last_only=True)


if __name__ == "__main__":
    main()
