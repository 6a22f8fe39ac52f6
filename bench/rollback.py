"""Anchor rollback vs recomputing the context by prefill, on a 2,000-token context, in one run.

    python bench/rollback.py [--context 2000] [--reps 5]

Builds a small Mixtral-shaped model with random weights (6 layers, hidden 256, 8 experts, top-2;
~90 MB in fp32), loads it into the engine and, side by side in one run:

- places 20 anchors along one branch while prefilling the context in 20 chunks, and reports the
  KV blocks in use against one KV cache of the context (the target is <= 1.1x);
- times `Session.rollback` to the anchor at the end of the context after a detour, with each
  validation mode ("blocks", the engine's default: every covered KV block rehashed; the opt-in
  "signature"; "full"), and the default validation alone (`verify_anchor`), against a fresh
  prefill of the same prefix (the baseline), and prints the medians and their ratios (the target
  is >= 100x);
- reports the KV bytes copied by a rollback and by the first decode after it (the partial
  last block, copied on write), and the bytes an anchor alone keeps alive after the session
  diverged, against a full copy of the KV cache.
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
from freetoken_agents.engine.anchors import DEFAULT_VALIDATION
from freetoken_agents.engine.anchors.anchor import verify_anchor

N_ANCHORS = 20


def build(folder: Path) -> Path:
    """Save a random Mixtral-shaped checkpoint to `folder` (deterministic)."""
    config = transformers.MixtralConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.fill_(1.0) if "norm" in name else p.normal_(0, 0.05)
    model.save_pretrained(folder)
    return folder


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2000, help="context length in tokens")
    parser.add_argument("--reps", type=int, default=5, help="re-prefill repetitions")
    args = parser.parse_args()
    n = args.context
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine.from_pretrained(build(Path(tmp) / "model"))
    pool, store = engine.kv_pool, engine.anchors
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, engine.spec.vocab_size, (2 * n,), generator=g).tolist()
    context, other = ids[:n], ids[n:]
    per_token = pool.bytes_per_block // pool.block_size
    full_copy = n * per_token
    print(
        f"model: mixtral-shaped, {engine.spec.num_layers} layers, hidden {engine.spec.hidden_size}, "
        f"8 experts top-2, fp32 | context {n} tokens | KV block {pool.block_size} tokens, "
        f"{per_token} bytes/token, one KV cache = {full_copy / 2**20:.2f} MiB | torch threads "
        f"{torch.get_num_threads()}"
    )

    session = engine.new_session()
    chunk = -(-n // N_ANCHORS)
    anchors = []
    for start in range(0, n, chunk):
        session.prefill(context[start : start + chunk], last_only=True)
        anchors.append(session.anchor("tool_result", label=f"at {session.position}"))
    one_cache = -(-n // pool.block_size)
    print(
        f"memory: {len(anchors)} anchors along the branch + the session hold {pool.blocks_in_use} KV "
        f"blocks; one KV cache of {n} tokens is {one_cache} blocks -> {pool.blocks_in_use / one_cache:.3f}x"
        f" (anchor-only bytes: {store.used_bytes})"
    )

    target = anchors[-1]
    modes = (DEFAULT_VALIDATION, "signature", "full")
    rollback_s: dict[str, list[float]] = {mode: [] for mode in modes}
    validation_s: list[float] = []  # the default validation alone, on a scratch view
    prefill_s: list[float] = []
    copied_by_rollback = 0
    for _ in range(args.reps):  # side by side: one re-prefill, then rollbacks, per repetition
        with engine.new_session() as fresh:
            prefill_s.append(timed(lambda fresh=fresh: fresh.prefill(context, last_only=True)))
        for mode in modes:
            for _ in range(5):
                session.prefill(other[:8], last_only=True)  # a detour past the anchor
                before = pool.copied_bytes
                rollback_s[mode].append(timed(lambda v=mode: session.rollback(target, validate=v)))
                copied_by_rollback += pool.copied_bytes - before
        view = target.table.fork()
        for _ in range(5):
            validation_s.append(timed(lambda v=view: verify_anchor(target, v, engine.model_fingerprint)))
        view.release()
    roll = {mode: statistics.median(times) for mode, times in rollback_s.items()}
    check, pre = statistics.median(validation_s), statistics.median(prefill_s)
    kv_mib = target.kv_length * per_token / 2**20
    print(
        f"default validation ({DEFAULT_VALIDATION!r}: rehash the {kv_mib:.2f} MiB of KV under the "
        f"{target.position}-token anchor): median {check * 1e3:.2f} ms | re-prefill of the same prefix: "
        f"median {pre * 1e3:.1f} ms | validation / re-prefill = {check / pre:.4f} "
        f"({pre / check:.0f}x cheaper)"
    )
    each = [f"{mode} {roll[mode] * 1e3:.2f} ms ({pre / roll[mode]:.0f}x vs re-prefill)" for mode in modes]
    print("rollback medians: " + ", ".join(each))

    mid = next((a for a in reversed(anchors) if a.kv_length % pool.block_size), anchors[0])
    session.rollback(mid)
    before = pool.copied_bytes
    session.decode(other[0])
    print(
        f"bytes copied: by {sum(len(t) for t in rollback_s.values())} rollbacks {copied_by_rollback}; "
        f"by the first decode after a rollback to the {mid.position}-token anchor (mid-block) "
        f"{pool.copied_bytes - before} (= one block of {pool.bytes_per_block}: the partial block) "
        f"| a full KV copy is {full_copy}"
    )

    half = anchors[len(anchors) // 2 - 1]
    session.rollback(half)
    session.prefill(other[: n - half.position], last_only=True)  # diverge: a new second half
    print(
        f"after diverging at {half.position} tokens: the {target.position}-token anchor alone keeps "
        f"{store.exclusive_bytes(target.id)} bytes alive, all anchors {store.used_bytes} bytes "
        f"(anchor-only blocks) vs a full KV copy of {full_copy} bytes per anchor "
        f"({N_ANCHORS * full_copy} for {N_ANCHORS} clones)"
    )
    session.close()


if __name__ == "__main__":
    main()
