"""Tier 1 as a slot pool (engine/memory/slot_pool.py, graph_steps.py): the tiered store keeps its
float experts in `ExpertSlots`, sized to tier 1's room, and a static (CUDA-graph) decode step runs
every MoE layer over the slots, answered by an eager rerun when a routed expert is not in tier 1.

On CPU the pool is asked for (`TieringOptions(expert_slots=True)`; the default there is off) and
the static step runs uncaptured, its attention through Triton's interpreter in a fresh process
(TRITON_INTERPRET=1 must precede triton's import). The captured graph runs in the `cuda` tests.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_models import ARCHS

from freetoken_agents.engine import Engine
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.memory import MemoryBudget, TieredExpertProvider
from freetoken_agents.engine.options import TieringOptions


@pytest.fixture(scope="module")
def ftw_of(tiny_checkpoint, tmp_path_factory):
    """`ftw_of(arch)`: the tiny model's fp32 FTW file (references load it too: same weights,
    same bits)."""
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = tmp_path_factory.mktemp("ftw") / f"{arch}.ftw"
            convert_checkpoint(tiny_checkpoint(arch), cache[arch], quant="fp32", progress=False)
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def compact_ftw_of(tiny_checkpoint, tmp_path_factory):
    """`compact_ftw_of(arch, codec)`: the tiny model with its experts stored as `codec` (int8 or
    mxfp4; the dense part bf16)."""
    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, codec: str) -> Path:
        if (arch, codec) not in cache:
            cache[(arch, codec)] = tmp_path_factory.mktemp("ftw") / f"{arch}-{codec}.ftw"
            convert_checkpoint(tiny_checkpoint(arch), cache[(arch, codec)], quant=codec, progress=False)
        return cache[(arch, codec)]

    return get


# What each stored codec keeps compact in tier 1: int8 by default, MXFP4 under "compact".
_EXPERT_QUANT = {"int8": "auto", "mxfp4": "compact"}


@pytest.fixture(scope="module")
def mixtral_ftw(ftw_of) -> Path:
    return ftw_of("mixtral")


def _tiered(engine: Engine) -> TieredExpertProvider:
    assert isinstance(engine.experts, TieredExpertProvider)
    return engine.experts


def _slotted(ftw: Path, fast_bytes: int | None, expert_quant: str = "auto") -> Engine:
    return Engine.from_pretrained(
        ftw,
        memory=MemoryBudget(fast_bytes=fast_bytes),
        placement="qstar",
        expert_quant=expert_quant,
        tiering=TieringOptions(prefetch=False, expert_slots=True),
    )


def _expert_bytes(ftw: Path, expert_quant: str = "auto") -> tuple[int, int]:
    """(one layer's top-k working set, one block of KV) of the tiny model."""
    probe = Engine.from_pretrained(ftw, memory=MemoryBudget(), placement="qstar", expert_quant=expert_quant)
    out = _tiered(probe).min_working_set, probe.kv_pool.bytes_per_block
    _tiered(probe).close()
    return out


def _decode_alike(ref: Engine, eng: Engine, steps: int) -> None:
    """The same prompt and `steps` decode steps give bit-identical logits on both engines."""
    ids = [5, 3, 8, 1, 9, 2, 7, 4]
    with ref.new_session() as a, eng.new_session() as b:
        assert torch.equal(a.prefill(ids), b.prefill(ids))
        for t in range(steps):
            assert torch.equal(a.decode(t), b.decode(t))


def _holds_slot_views(tp: TieredExpertProvider):
    """Tier 1 holds exactly the pool's experts, as views of their slots; the pool."""
    pool = tp.moves.slots.pool
    assert pool is not None and len(pool) == len(tp.fast)
    for key in tp.fast.keys():
        assert tp.fast.peek(key).gate_up.data_ptr() == pool.stack.gate_up[pool.slot_of(key)].data_ptr()
    return pool


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("room", [None, 2])
def test_a_slotted_tier_1_decodes_the_resident_engines_tokens(ftw_of, arch, room):
    """Every architecture and budget: tier 1 holds its float experts as slot views, evictions
    free slots, and the logits are those of the resident engine (same file, same bits: the CPU
    decode step still loops over the experts' views in ascending id)."""
    ftw = ftw_of(arch)
    working_set, kv_block = _expert_bytes(ftw)
    fast = None if room is None else room * working_set + 8 * kv_block
    ref, eng = Engine.from_pretrained(ftw), _slotted(ftw, fast)
    tp = _tiered(eng)
    _decode_alike(ref, eng, 24)
    pool = _holds_slot_views(tp)
    if room is not None:
        assert tp.fast.counters.evictions > 0
        unit = tp.fast_bytes[tp.keys()[0]]  # what tier 1 counts per expert
        assert pool.capacity == tp.fast.capacity_bytes // unit
    tp.close()


@pytest.mark.parametrize("codec", ["int8", "mxfp4"])
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_compact_experts_take_slots_of_their_own_layout_in_tier_1(compact_ftw_of, arch, codec):
    """int8 / MXFP4 experts kept compact in tier 1 live in a pool of their own layout (weights,
    scales and biases each in its dtype): tier 1 holds the slots' views, evictions free slots,
    and the logits are the resident engine's on the same file (bit for bit: a CPU decode step
    loops over the views, as the resident engine loops over its stack's)."""
    ftw, expert_quant = compact_ftw_of(arch, codec), _EXPERT_QUANT[codec]
    working_set, kv_block = _expert_bytes(ftw, expert_quant)
    ref = Engine.from_pretrained(ftw, expert_quant=expert_quant)
    # Room for two layers' working sets beside the 24 tokens' KV (compact experts are small:
    # the KV blocks of the other tests' budgets would hold every expert here).
    eng = _slotted(ftw, 2 * working_set + 3 * kv_block, expert_quant)
    tp = _tiered(eng)
    _decode_alike(ref, eng, 16)
    pool = _holds_slot_views(tp)
    assert tp.moves.tier1_codec == codec and pool.stack.codec == codec and tp.fast.counters.evictions > 0
    assert all(tp.fast.peek(key).gate_up_scale is not None for key in tp.fast.keys())
    tp.close()


def test_rollback_restores_a_slotted_tier_1_and_its_tokens(mixtral_ftw):
    """An anchor records which experts tier 1 held; after a rollback (the slots re-warmed) the
    session decodes what it decoded the first time, as the resident engine does."""
    working_set, kv_block = _expert_bytes(mixtral_ftw)
    ref, eng = Engine.from_pretrained(mixtral_ftw), _slotted(mixtral_ftw, 2 * working_set + 8 * kv_block)
    tp = _tiered(eng)
    with ref.new_session() as a, eng.new_session() as b:
        a.prefill([5, 3, 8, 1])
        b.prefill([5, 3, 8, 1])
        mark = b.anchor("tool_call")
        first = [b.decode(t) for t in (2, 9, 4, 7, 6, 1)]
        want = [a.decode(t) for t in (2, 9, 4, 7, 6, 1)]
        b.rollback(mark)
        again = [b.decode(t) for t in (2, 9, 4, 7, 6, 1)]
    for x, y, z in zip(first, again, want, strict=True):
        assert torch.equal(x, z) and torch.equal(y, z)
    pool = tp.moves.slots.pool
    assert pool is not None and len(pool) == len(tp.fast)
    tp.close()


def test_the_slot_pool_follows_tier_1_when_the_kv_cache_grows(mixtral_ftw):
    """KV growth shrinks tier 1: the pool is reallocated to the new room (its epoch changes, so a
    captured graph is captured again), the experts it keeps keep their values."""
    working_set, kv_block = _expert_bytes(mixtral_ftw)
    eng = _slotted(mixtral_ftw, 4 * working_set + 4 * kv_block)
    tp = _tiered(eng)
    for key in tp.keys():
        tp.get(*key)
    slots = tp.moves.slots
    before, epoch = slots.pool.capacity, tp.graph_epoch
    kept = {k: tp.fast.peek(k).gate_up.clone() for k in tp.fast.keys()}
    tp.on_kv_resize(4 * kv_block + 2 * working_set)
    assert slots.pool.capacity < before and tp.graph_epoch != epoch
    assert len(slots.pool) == len(tp.fast) > 0
    for key in tp.fast.keys():
        assert torch.equal(tp.fast.peek(key).gate_up, kept[key])
        view = slots.pool.weights(slots.pool.slot_of(key))
        assert tp.fast.peek(key).gate_up.data_ptr() == view.gate_up.data_ptr()
    tp.on_kv_resize(0)
    tp.get(*tp.keys()[0])
    tp.close()


def test_slots_are_off_on_a_cpu_unless_asked_for(mixtral_ftw):
    tp = _tiered(Engine.from_pretrained(mixtral_ftw, memory=MemoryBudget(), placement="qstar"))
    assert tp.moves.slots is None and not tp.graph_safe
    tp.close()


_STATIC_TIERED = textwrap.dedent(
    """
    import sys, torch
    from freetoken_agents.engine import Engine
    from freetoken_agents.engine.kernels import int8
    from freetoken_agents.engine.runtime.cuda_graph import DecodeGraphs, StaticDecode
    from freetoken_agents.engine.memory import MemoryBudget, TieredExpertProvider
    from freetoken_agents.engine.options import TieringOptions

    path, fast = sys.argv[1], (None if sys.argv[2] == "all" else int(sys.argv[2]))
    expert_quant = sys.argv[3]
    # The CPU's int8 kernel rounds activations to bf16; the fp32 dequantize path is the exact
    # reference for the interpreter's fp32 GEMVs (the reference and the eager reruns take it).
    int8.KERNEL_MAX_TOKENS = 0
    ref = Engine.from_pretrained(path, expert_quant=expert_quant)
    eng = Engine.from_pretrained(
        path, memory=MemoryBudget(fast_bytes=fast), placement="qstar", expert_quant=expert_quant,
        tiering=TieringOptions(prefetch=False, expert_slots=True),
    )
    runner = eng.decode_runner
    graphs = DecodeGraphs(eng.model, StaticDecode)  # what a CUDA device would capture
    runner.use_graphs(graphs)
    tp = eng.experts
    ids = torch.randint(0, ref.spec.vocab_size, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    with ref.new_session() as a, eng.new_session() as b:
        a.prefill(ids[:12])
        b.prefill(ids[:12])
        want = torch.stack([a.decode(t) for t in ids[12:]])
        got = torch.stack([b.decode(t) for t in ids[12:]])
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-4, err
    steps = tp.stats()["graph_steps"]
    print("OK", err, graphs.replays, graphs.reruns, steps)
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize(
    ("arch", "codec", "room"),
    [
        ("mixtral", "fp32", "all"),
        ("mixtral", "fp32", 2),
        ("gpt_oss", "fp32", "all"),
        ("deepseek_v3", "fp32", 2),
        ("mixtral", "int8", "all"),
        ("gpt_oss", "mxfp4", "all"),
    ],
)
def test_the_static_tiered_step_decodes_the_resident_engines_tokens(
    ftw_of, compact_ftw_of, arch, codec, room
):
    """Uncaptured static steps over the slot pool (float: the grouped GEMM; int8 / MXFP4 kept
    compact: the grouped GEMVs): the same tokens as the resident engine. With every expert
    fitting, replays stop missing once tier 1 is warm; with room for two layers' working sets,
    replays miss, are recomputed eagerly (q* decides for the misses), and the store stops asking
    for replays while they would miss."""
    ftw = ftw_of(arch) if codec == "fp32" else compact_ftw_of(arch, codec)
    expert_quant, fast = _EXPERT_QUANT.get(codec, "auto"), "all"
    if room != "all":
        working_set, kv_block = _expert_bytes(ftw, expert_quant)
        fast = str(room * working_set + 8 * kv_block)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", _STATIC_TIERED, str(ftw), fast, expert_quant]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]
    _, _, replays, reruns, *_ = done.stdout.split()[:5]
    replays, reruns = int(replays), int(reruns)
    if room == "all":
        assert replays == 48 and reruns < replays // 2  # only the warm-up steps missed
    else:
        assert reruns > 0 and replays < 48  # misses were recomputed, then replays declined


def test_the_pool_has_a_slot_for_every_expert_tier_1_counts_in_its_room():
    """A slot row is padded for alignment, so it is larger than what tier 1 counts per expert; the
    pool is sized by tier 1's count (3 experts' bytes: 3 slots), never turning one away."""
    from freetoken_agents.engine.memory.slot_pool import TierSlots
    from freetoken_agents.engine.model.experts import ExpertWeights

    g = torch.Generator().manual_seed(0)
    expert = ExpertWeights.packed(
        {"gate_up": torch.randn(10, 5, generator=g), "down": torch.randn(5, 5, generator=g)}, torch.float32
    )
    unit = expert.nbytes  # 75 floats; a slot row is padded to 128
    slots = TierSlots(num_layers=1, num_experts=4, total_experts=4, device=torch.device("cpu"))
    for e in range(3):
        assert slots.assign((0, e), expert, 3 * unit, unit) is not None
    assert slots.pool is not None and slots.pool.capacity == 3 and slots.pool.row_bytes > unit
    assert slots.assign((0, 3), expert, 4 * unit, unit) is not None  # tier 1 grew: so does the pool
    assert slots.pool.capacity == 4 and slots.epoch == 2
    slots.release((0, 0))
    slots.fit(2 * unit)  # cannot shrink below what it holds (tier 1 evicts first)
    assert slots.pool.capacity == 3 and len(slots.pool) == 3


def test_a_cpu_top2_all_hit_step_runs_both_slots_as_one_pair(mixtral_ftw, monkeypatch):
    """Issue 61: a CPU decode step whose two routed experts are both in tier 1's slot pool runs
    them as one batched GEMV per projection (`grouped_experts.run_pair` over the slots, as the
    resident engine runs its stack), not a loop of separate matmuls, with the resident engine's
    bits also when a pair's slots are in the opposite order of its expert ids (the outputs are
    added in ascending expert id)."""
    from freetoken_agents.engine.memory import provider

    pairs: list[tuple[list[int], list[int]]] = []
    real = provider.run_pair

    def spy(stack, hidden, slots, weights, spec, keys=None):
        pairs.append((list(slots), list(keys)))
        return real(stack, hidden, slots, weights, spec, keys)

    monkeypatch.setattr(provider, "run_pair", spy)
    working_set, kv_block = _expert_bytes(mixtral_ftw)
    # room for a few layers' pairs: evictions reuse slots, so a pair's slots come in any order
    ref, eng = Engine.from_pretrained(mixtral_ftw), _slotted(mixtral_ftw, 3 * working_set + 8 * kv_block)
    tp = _tiered(eng)
    _decode_alike(ref, eng, 48)
    assert pairs, "no all-hit decode step ran as a pair"
    reversed_pairs = [p for p in pairs if (p[0][0] < p[0][1]) != (p[1][0] < p[1][1])]
    assert reversed_pairs, "every pair's slots were in expert order: the test proves no ordering"
    tp.close()
