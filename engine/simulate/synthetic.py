"""Synthetic decode routing traces with set temporal reuse, popularity skew and cross-layer
correlation (issue 33), for replays where no recorded trace of a model exists.

`synthetic_trace(layers=..., num_experts=..., top_k=..., tokens=..., reuse=..., skew=...,
cross_layer=..., seed=...)` routes each token t of each sequence at each layer l (layers 0..L-1) to
`top_k` distinct experts, filled in this order:

1. **reuse**: each expert the same sequence's token t - 1 routed at layer l is routed again,
   independently, with probability `reuse` (token 0 has none);
2. **cross_layer**: each slot still free takes, with probability `cross_layer`, one expert (drawn
   uniformly) of those token t routed at layer l - 1 that is not already chosen and not one of token
   t - 1's experts at l (which step 1 alone decides), when there is one (layer 0 has none);
3. **popularity**: the slots left are drawn without replacement from layer l's popularity, except
   token t - 1's experts at l: so token t - 1's experts come back only through step 1, and the
   expected temporal reuse `stats.trace_stats` measures is `reuse` itself.

Popularity (`skew`): each layer's experts get Zipf weights rank^-skew (rank 1..num_experts) in a
random order of their own per layer; skew 0 is uniform. The measured cross-layer rate grows with
`cross_layer` but is not it: about `cross_layer` x (1 - `reuse`) (the slots step 1 leaves free)
plus the chance matches of the other slots (about top_k / num_experts each; `cross_layer` 0 gives
chance, not 0). The measured top-10% share grows with `skew` (and a little with a trace's finite
length: skew 0 with Mixtral's shape and reuse over 577 tokens gives ~11.4%, not 10%).

Weights: the softmax of top_k standard normal logits, sorted descending, so the experts are in
router order (heaviest first) and their weights sum to 1. Deterministic for a seed (numpy PCG64).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..memory.routing_trace import RoutingRecord


@dataclass(frozen=True)
class SyntheticParams:
    """A model's routing shape and the generator's knobs (module docstring)."""

    layers: int
    num_experts: int
    top_k: int
    reuse: float
    skew: float
    cross_layer: float
    note: str = ""


# Calibrated on the published decode routing of Mixtral-8x7B-Instruct (vLLM, HumanEval and GSM8K
# prompts, 577 decode tokens x 32 layers, top-2 of 8): temporal reuse 37.5% (random 25%),
# same index in the next layer 24.2% (random 25%), most used 10% of (layer, expert) pairs 13.6% of
# uses, and misses per token with 128 of 256 entries cached: LRU 28.6, decayed frequency 27.0,
# Belady 12.2. Reached (577 tokens, seeds 0-7, `stats.trace_stats`): reuse 37.2-38.0%, cross-layer
# 24.6-25.2%, top-10% share 13.3-13.6%, misses per token LRU 30.4-31.2 (+7%), decayed frequency
# 28.4-28.8 (+6%), Belady 12.1-12.3; checked in tests/test_simulate_traces.py.
MIXTRAL_8X7B = SyntheticParams(
    layers=32,
    num_experts=8,
    top_k=2,
    reuse=0.375,
    skew=0.35,
    cross_layer=0.0,
    note="Mixtral-8x7B-Instruct decode routing (published figures)",
)

# Qwen3-30B-A3B: 48 layers, 128 experts, top-8. No published decode figures to match; assumed:
# - temporal reuse: Mixtral's stickiness, the share of the non-chance slots that stick,
#   (37.5% - 25%) / (1 - 25%) = 1/6, on Qwen's chance 8/128 = 6.25%: 6.25% + 93.75% / 6 = 21.875%;
# - cross-layer: chance only (as Mixtral's 24.2% against 25%);
# - popularity: Zipf 0.5, the most used expert of a layer ~4.7% of its uses. Cited: a llama.cpp
#   imatrix count of Qwen3-30B-A3B's routing (third-party, prompt and generation tokens together,
#   https://mcp-tool-shop-org.github.io/gpu-container/handbook/derisk/) gives the top expert of a
#   layer 4.3% (diverse text, ~1k tokens) to 6.3% (Python, ~8k tokens) of its routing, and 90% of
#   it on 51% (45%) of the experts; a Zipf law cannot match both (Zipf 0.5 puts 90% on ~83%), so
#   this preset keeps the head and understates the cold tail. Measured on 300 tokens: top-10%
#   share ~24.7%, misses per token with half the pairs cached LRU ~141, frequency ~135, Belady ~62
#   of 384 accesses.
QWEN3_30B_A3B = SyntheticParams(
    layers=48,
    num_experts=128,
    top_k=8,
    reuse=0.21875,
    skew=0.5,
    cross_layer=0.0,
    note="Qwen3-30B-A3B, assumed (no published figures)",
)


def synthetic_trace(
    *,
    layers: int,
    num_experts: int,
    top_k: int,
    tokens: int,
    seqs: int = 1,
    reuse: float,
    skew: float,
    cross_layer: float,
    seed: int,
) -> list[RoutingRecord]:
    """`seqs` sequences of `tokens` decode tokens each, routed at layers 0..`layers`-1 as the module
    docstring says; records in (seq, token, layer) order."""
    if layers < 1 or tokens < 0 or seqs < 0:
        raise ValueError(f"need layers >= 1, tokens >= 0, seqs >= 0; got {layers}, {tokens}, {seqs}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..num_experts ({num_experts}), got {top_k}")
    for name, p in (("reuse", reuse), ("cross_layer", cross_layer)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {p}")
    if skew < 0:
        raise ValueError(f"skew must be >= 0, got {skew}")
    rng = np.random.default_rng(seed)
    zipf = np.arange(1, num_experts + 1, dtype=np.float64) ** -skew
    popularity = np.stack([zipf[rng.permutation(num_experts)] for _ in range(layers)])
    popularity /= popularity.sum(axis=1, keepdims=True)

    records: list[RoutingRecord] = []
    for seq in range(seqs):
        before: list[list[int]] = [[] for _ in range(layers)]  # token t - 1's experts per layer
        for tok in range(tokens):
            below: list[int] = []  # this token's experts at the layer before
            for layer in range(layers):
                prev = before[layer]
                chosen = [e for e in prev if rng.random() < reuse][:top_k]
                barred = set(prev) | set(chosen)
                free = top_k - len(chosen)
                for _ in range(free):
                    if below and rng.random() < cross_layer:
                        pool = [e for e in below if e not in barred]
                        if pool:
                            e = pool[int(rng.integers(len(pool)))]
                            chosen.append(e)
                            barred.add(e)
                rest = top_k - len(chosen)
                if rest:
                    p = popularity[layer].copy()
                    p[list(barred)] = 0.0
                    if p.sum() <= 0 or np.count_nonzero(p) < rest:  # too few left: any not chosen
                        p = np.ones(num_experts)
                        p[chosen] = 0.0
                    chosen += [
                        int(e) for e in rng.choice(num_experts, size=rest, replace=False, p=p / p.sum())
                    ]
                order = rng.permutation(top_k)
                experts = tuple(chosen[j] for j in order)
                logits = np.sort(rng.standard_normal(top_k))[::-1]
                w = np.exp(logits - logits[0])
                w /= w.sum()
                records.append(RoutingRecord(seq, tok, layer, experts, tuple(float(x) for x in w), "decode"))
                before[layer] = list(experts)
                below = list(experts)
    return records


def preset_trace(
    params: SyntheticParams, *, tokens: int, seqs: int = 1, seed: int = 0
) -> list[RoutingRecord]:
    """`synthetic_trace` with a preset's model shape and knobs."""
    return synthetic_trace(
        layers=params.layers,
        num_experts=params.num_experts,
        top_k=params.top_k,
        tokens=tokens,
        seqs=seqs,
        reuse=params.reuse,
        skew=params.skew,
        cross_layer=params.cross_layer,
        seed=seed,
    )
