"""Routing-trace statistics and synthetic traces (issue 33): each figure of `trace_stats` on hand-made
traces with known answers, Belady exact and never worse than LRU, the generator deterministic and
valid, and the Mixtral preset near the published Mixtral-8x7B decode figures."""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections import OrderedDict

import numpy as np
import pytest

from freetoken_agents.engine.memory.routing_trace import RoutingRecord, RoutingTraceError
from freetoken_agents.engine.simulate.stats import (
    belady_misses,
    belady_missing,
    filled_at_load,
    frequency_misses,
    lru_misses,
    lru_missing,
    top_share,
    trace_stats,
)
from freetoken_agents.engine.simulate.synthetic import (
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    preset_trace,
    synthetic_trace,
)


def rec(seq, token, layer, experts, phase="decode"):
    k = len(experts)
    return RoutingRecord(seq, token, layer, tuple(experts), (1.0 / k,) * k, phase)


def one_layer(experts):
    """One sequence, one layer, one expert per token."""
    return [rec(0, t, 0, [e]) for t, e in enumerate(experts)]


# --- trace_stats on hand-made traces -------------------------------------------------------------


def test_reuse_cross_layer_and_top_share_by_hand():
    records = [
        # seq 0; layers 0 and 2 (layer 1 dense: no records), top-2 of 4
        rec(0, 0, 0, [0, 1]),
        rec(0, 0, 2, [1, 2]),
        rec(0, 1, 0, [0, 3]),
        rec(0, 1, 2, [2, 1]),
        # seq 1 token 0: its previous token is not seq 0's token 1
        rec(1, 0, 2, [1, 2]),
        rec(1, 0, 0, [0, 1]),
        rec(1, 1, 0, [3, 2], phase="prefill"),  # another phase: left out
    ]
    s = trace_stats(records, num_experts=4)
    assert (s.records, s.tokens, s.sequences, s.layers, s.top_k) == (6, 3, 2, 2, 2.0)
    # seq 0 token 1: layer 0 keeps 0 of {0, 3}, layer 2 keeps both -> 3 of 4
    assert s.reuse == pytest.approx(3 / 4)
    assert s.reuse_random == pytest.approx(2 / 4)
    # layer 0 -> layer 2 of each token: 1 ({1}) + 0 + 1 ({1}) of 6
    assert s.cross_layer == pytest.approx(2 / 6)
    assert s.cross_layer_random == pytest.approx(2 / 4)
    # uses: layer 0 {0: 3, 1: 2, 3: 1}, layer 2 {1: 3, 2: 3}; 10% of 8 pairs = 0.8 of the top one
    assert s.top10_share == pytest.approx(0.8 * 3 / 12)
    assert s.accesses_per_token == pytest.approx(4.0)
    assert s.cache_entries == 4
    assert math.isclose(trace_stats(records, num_experts=4, phase=None).records, 7)
    doc = json.loads(s.to_json())
    assert doc["reuse"] == pytest.approx(0.75) and doc["phase"] == "decode"


def test_a_figure_with_nothing_to_count_is_none_in_json():
    s = trace_stats([rec(0, 0, 0, [1, 2])], num_experts=4)
    assert math.isnan(s.reuse) and math.isnan(s.cross_layer)
    assert s.to_dict()["reuse"] is None
    json.loads(s.to_json())


def test_top_share_counts_a_fractional_last_entry_pro_rata():
    assert top_share(np.array([2, 5, 3]), 0.5) == pytest.approx((5 + 0.5 * 3) / 10)
    assert top_share(np.array([1, 1, 1, 1, 1, 1, 1, 1, 1, 1]), 0.1) == pytest.approx(0.1)
    assert top_share(np.zeros(4, dtype=int), 0.1) != top_share(np.zeros(4, dtype=int), 0.1)  # NaN


def test_cache_misses_by_hand():
    # 1 layer x 4 experts, half cached: 2 entries.
    # 0 1 2 0 1 3 0: LRU misses all 7; decayed frequency (0.9) too (worked out in the comments
    # below); Belady keeps 0 (used again soonest) and misses 5.
    # frequency: t2 evicts 0 (0.81 < 0.9); t3 evicts 1 (0.81 < 0.9); t4 evicts 2 (0.81 < 1.5561);
    # t5 evicts 0 (1.40049 < 1.5561); t6 evicts 3 (0.9 < 1.40049).
    s = trace_stats(one_layer([0, 1, 2, 0, 1, 3, 0]), num_experts=4)
    assert s.cache_entries == 2
    assert s.misses_per_token_lru == pytest.approx(7 / 7)
    assert s.misses_per_token_frequency == pytest.approx(7 / 7)
    assert s.misses_per_token_belady == pytest.approx(5 / 7)
    # 0 0 0 1 2 0: LRU evicts 0 for 2 and misses it again (4); frequency keeps 0 (2.1951 > 0.9)
    # and evicts 1 (3); Belady evicts 1, never used again (3).
    s = trace_stats(one_layer([0, 0, 0, 1, 2, 0]), num_experts=4)
    assert s.misses_per_token_lru == pytest.approx(4 / 6)
    assert s.misses_per_token_frequency == pytest.approx(3 / 6)
    assert s.misses_per_token_belady == pytest.approx(3 / 6)


def test_a_record_never_evicts_its_own_experts():
    # top-2 of 4, one layer, 2 entries: {0,1} {1,2} {0,2} -> 2 + 1 + 1 misses under every order
    steps = [[0, 1], [1, 2], [0, 2]]
    assert lru_misses(steps, 2) == 4
    assert belady_misses(steps, 2) == 4
    assert frequency_misses(steps, [0, 0, 0], 2, 1, 4) == 4
    with pytest.raises(ValueError, match="cannot hold"):
        trace_stats([rec(0, 0, 0, [0, 1, 2])], num_experts=4)


def test_the_cache_is_shared_by_all_layers_and_sequences():
    # 2 layers x 2 experts, 2 entries: layer 0 expert 0 and layer 1 expert 0 fill it; the second
    # sequence hits both.
    records = [rec(s, 0, layer, [0]) for s in (0, 1) for layer in (0, 1)]
    s = trace_stats(records, num_experts=2)
    assert s.cache_entries == 2
    assert s.misses_per_token_lru == pytest.approx(2 / 2)
    assert s.misses_per_token_belady == pytest.approx(2 / 2)


def brute_force_optimum(steps, capacity, start=frozenset()):
    """The fewest misses over every eviction choice (single-key steps), from the cache `start`."""

    @functools.cache
    def best(i, cache):
        if i == len(steps):
            return 0
        k = steps[i]
        if k in cache:
            return best(i + 1, cache)
        if len(cache) < capacity:
            return 1 + best(i + 1, cache | {k})
        return 1 + min(best(i + 1, (cache - {v}) | {k}) for v in cache)

    return best(0, frozenset(start))


def test_belady_is_the_optimum_and_never_worse_than_lru_or_frequency():
    rng = np.random.default_rng(7)
    for _ in range(40):
        steps = [[int(k)] for k in rng.integers(0, 5, size=12)]
        assert belady_misses(steps, 2) == brute_force_optimum(tuple(k for (k,) in steps), 2)
    for seed in range(20):
        rng = np.random.default_rng(seed)
        layers, n, k = 3, 6, 2
        steps = [
            [int(e) + layer * n for e in rng.choice(n, size=k, replace=False)]
            for _ in range(60)
            for layer in range(layers)
        ]
        layer_of = [i % layers for i in range(len(steps))]
        for capacity in (2, 5, 9, 14):
            b = belady_misses(steps, capacity)
            assert b <= lru_misses(steps, capacity)
            assert b <= frequency_misses(steps, layer_of, capacity, layers, n)


def test_filled_at_load_is_the_best_fill_for_belady_and_lrus_own():
    """The baselines and bounds start with tier 1 filled, as every policy's does: Belady's misses
    after `filled_at_load` are the fewest over every fill of the cache and every eviction; LRU's
    are those of an LRU cache holding the first keys used, each fresh at its first use."""
    rng = np.random.default_rng(11)
    for _ in range(25):
        keys = [int(k) for k in rng.integers(0, 5, size=12)]
        steps = [[k] for k in keys]
        filled = sum(map(len, filled_at_load(belady_missing(steps, 2), 2)))
        fills = itertools.combinations(range(5), 2)
        assert filled == min(brute_force_optimum(tuple(keys), 2, f) for f in fills)
    for seed in range(10):
        rng = np.random.default_rng(seed)
        steps = [[int(e) for e in rng.choice(12, size=3, replace=False)] for _ in range(40)]
        for capacity in (3, 5, 8):
            first = list(dict.fromkeys(k for keys in steps for k in keys))[:capacity]
            cache, used, direct = OrderedDict.fromkeys(first), set(), []
            for keys in steps:
                missing = [k for k in keys if k not in cache]
                for k in keys:  # hits, then first uses and misses: the order an empty cache loads
                    if k in used and k in cache:
                        cache.move_to_end(k)
                for k in keys:
                    if k in cache and k not in used:
                        cache.move_to_end(k)
                for _ in range(len(cache) + len(missing) - capacity):
                    cache.popitem(last=False)
                cache.update(dict.fromkeys(missing))
                used.update(keys)
                direct.append(missing)
            assert filled_at_load(lru_missing(steps, capacity), capacity) == direct


def test_bad_traces_are_refused():
    with pytest.raises(RoutingTraceError, match="expert 9"):
        trace_stats([rec(0, 0, 0, [9])], num_experts=8)
    with pytest.raises(RoutingTraceError, match="two records"):
        trace_stats([rec(0, 0, 0, [1]), rec(0, 0, 0, [2])], num_experts=8)
    with pytest.raises(ValueError, match="no decode records"):
        trace_stats([rec(0, 0, 0, [1], phase="prefill")], num_experts=8)


def test_uniform_random_routing_reuses_at_chance():
    rng = np.random.default_rng(3)
    n, k = 8, 2
    records = [
        rec(0, t, layer, [int(e) for e in rng.choice(n, size=k, replace=False)])
        for t in range(400)
        for layer in range(8)
    ]
    s = trace_stats(records, num_experts=n)
    assert s.reuse_random == pytest.approx(k / n)
    assert s.reuse == pytest.approx(k / n, abs=0.02)
    assert s.cross_layer == pytest.approx(k / n, abs=0.02)
    assert s.top10_share == pytest.approx(0.10, abs=0.02)
    # the generator with reuse at chance and no skew or cross-layer pull: the same
    g = trace_stats(
        synthetic_trace(
            layers=8, num_experts=n, top_k=k, tokens=400, reuse=k / n, skew=0, cross_layer=0, seed=1
        ),
        num_experts=n,
    )
    assert g.reuse == pytest.approx(k / n, abs=0.02)
    assert g.cross_layer == pytest.approx(k / n, abs=0.02)


# --- synthetic traces ----------------------------------------------------------------------------


def small(seed, **kw):
    args = dict(layers=4, num_experts=16, top_k=4, tokens=30, seqs=2, reuse=0.5, skew=0.8, cross_layer=0.3)
    args.update(kw)
    return synthetic_trace(seed=seed, **args)


def test_the_generator_is_deterministic_for_a_seed():
    assert small(5) == small(5)
    assert small(5) != small(6)


def test_generated_records_are_valid():
    for params in ({}, {"reuse": 1.0, "cross_layer": 1.0}, {"top_k": 16}, {"skew": 3.0}):
        records = small(2, **params)
        k = params.get("top_k", 4)
        assert len(records) == 2 * 30 * 4
        assert [(r.seq, r.token, r.layer) for r in records] == sorted(
            (r.seq, r.token, r.layer) for r in records
        )
        for r in records:
            assert r.phase == "decode"
            assert len(r.experts) == k == len(set(r.experts)) == len(r.weights)
            assert all(0 <= e < 16 for e in r.experts)
            assert math.isclose(sum(r.weights), 1.0, rel_tol=1e-9)
            assert list(r.weights) == sorted(r.weights, reverse=True)


def test_the_knobs_move_the_figures():
    base = dict(layers=8, num_experts=16, top_k=2, tokens=300, skew=0.0, seed=0)
    sticky = trace_stats(synthetic_trace(reuse=0.6, cross_layer=0.0, **base), num_experts=16)
    assert sticky.reuse == pytest.approx(0.6, abs=0.04)
    pulled = trace_stats(synthetic_trace(reuse=0.125, cross_layer=0.5, **base), num_experts=16)
    # about cross_layer x (1 - reuse) pulled, plus the chance matches of the other slots
    assert 0.5 * 0.875 <= pulled.cross_layer <= 0.5 * 0.875 + 0.5625 * 2 / 16 + 0.03
    flat = trace_stats(synthetic_trace(reuse=0.125, cross_layer=0.0, **base), num_experts=16)
    skewed = trace_stats(
        synthetic_trace(reuse=0.125, cross_layer=0.0, **{**base, "skew": 1.2}), num_experts=16
    )
    assert skewed.top10_share > flat.top10_share + 0.05
    assert pulled.cross_layer > flat.cross_layer + 0.2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_mixtral_preset_lands_near_the_published_figures(seed):
    records = preset_trace(MIXTRAL_8X7B, tokens=577, seed=seed)
    assert len(records) == 577 * 32
    s = trace_stats(records, num_experts=MIXTRAL_8X7B.num_experts)
    assert s.cache_entries == 128
    assert s.reuse == pytest.approx(0.375, abs=0.03)
    assert s.cross_layer == pytest.approx(0.242, abs=0.03)
    assert s.top10_share == pytest.approx(0.136, abs=0.03)
    assert s.misses_per_token_lru == pytest.approx(28.6, rel=0.15)
    assert s.misses_per_token_frequency == pytest.approx(27.0, rel=0.15)
    assert s.misses_per_token_belady == pytest.approx(12.2, rel=0.15)


def test_the_qwen3_preset_has_the_model_shape():
    records = preset_trace(QWEN3_30B_A3B, tokens=40, seed=0)
    assert len(records) == 40 * 48
    assert {len(r.experts) for r in records} == {8}
    s = trace_stats(records, num_experts=128)
    assert s.reuse == pytest.approx(QWEN3_30B_A3B.reuse, abs=0.03)
    assert s.misses_per_token_belady <= s.misses_per_token_lru
