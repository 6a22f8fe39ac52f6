"""`machine.ExpertCosts` on hand-written profiles: the exact seconds it charges (dense part in the
compute dtype, the fixed overheads), and profiles without the optional overhead keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from freetoken_agents.engine.simulate.machine import ExpertCosts
from freetoken_agents.engine.simulate.profiles import HardwareProfile, ProfileError, load_profile
from freetoken_agents.engine.simulate.shapes import ModelShape

SHAPE = ModelShape(
    name="toy",
    model_type="mixtral",
    num_layers=4,  # 2 of them MoE: each MoE layer carries two layers' fixed overhead
    moe_layers=(1, 3),
    num_experts=8,
    top_k=2,
    hidden=64,
    intermediate=128,
    gated=True,
    expert_bias=False,
    vocab_size=1000,
    tie_word_embeddings=False,
    dense_matrices=((4, 64, 64),),
    dense_vector_elems=4 * 2 * 64,
    fp32_elems=0,
)

REQUIRED = dict(
    link_gbps=4.0,
    link_latency_us=1.0,
    device_mem_gbps=10.0,
    device_mem_bytes=1 << 34,
    device_bf16_tflops=1e-3,  # 1 GFLOP/s: flops never bind below
    device_lowp_tflops=1e-3,
    host_mem_gbps=10.0,
    host_mem_bytes=1 << 34,
    disk_gbps=2.0,
    cpu_gflops=1000.0,
    cpu_cores=2,
)
OVERHEADS = dict(layer_overhead_us=100.0, expert_overhead_us=20.0, tier_overhead_us=50.0)


def _profile(device: str, **over: float) -> HardwareProfile:
    return HardwareProfile(name=device, device=device, **{**REQUIRED, "device_bf16_tflops": 1e3, **over})  # type: ignore[arg-type]


def test_cpu_costs_exact() -> None:
    p = _profile("cpu", device_lowp_tflops=1e3, **OVERHEADS)
    c = ExpertCosts.of(SHAPE, p, "fp32")
    expert_fp32 = 3 * 64 * 128 * 4  # gate, up, down
    assert c.fast_bytes == c.stored_bytes == expert_fp32
    # dense in fp32 on a CPU (the engine's dtype there): per MoE layer, half the model's
    dense = SHAPE.dense_bytes_per_token("fp32") / 2
    assert dense > SHAPE.dense_bytes_per_token("bf16") / 2
    assert c.dense_s(1) == pytest.approx(dense / 10e9 + 2 * 100e-6)  # 4 layers' overhead on 2
    assert c.fast_compute_s(1) == pytest.approx(expert_fp32 / 10e9 + 20e-6)
    assert c.host_compute_s(1) == pytest.approx(expert_fp32 / 10e9 + 20e-6)
    assert c.tier_overhead_s == pytest.approx(50e-6)
    # promotion: bookkeeping in place (the block moves up), a copy at the copy bandwidth otherwise
    assert c.link_s == c.promote_s(True) == pytest.approx(20e-6)
    assert c.promote_s(False) == pytest.approx(20e-6 + 2 * expert_fp32 / 4e9)
    assert c.decode_s == 0.0
    # int8 stays compact and is used in place too
    q = ExpertCosts.of(SHAPE, p, "int8")
    assert q.promote_s(True) == pytest.approx(20e-6)
    assert q.fast_compute_s(1) == pytest.approx(q.fast_bytes / 10e9 + 20e-6)


def test_cuda_dense_in_bf16_with_overheads() -> None:
    p = _profile("cuda", **OVERHEADS)
    c = ExpertCosts.of(SHAPE, p, "bf16")
    dense = SHAPE.dense_bytes_per_token("bf16") / 2
    assert c.dense_s(1) == pytest.approx(dense / 10e9 + 2 * 100e-6)
    assert c.fast_compute_s(1) == pytest.approx(c.fast_bytes / 10e9 + 20e-6)
    # the link is PCIe on a GPU: unchanged by the overheads, the same whether or not it moves up
    assert c.link_s == c.promote_s(False) == pytest.approx(1e-6 + c.stored_bytes / 4e9)


def test_layer_and_expert_overheads_default_to_zero() -> None:
    p = _profile("cpu")
    assert (p.layer_overhead_us, p.expert_overhead_us) == (0.0, 0.0)
    c = ExpertCosts.of(SHAPE, p, "fp32")
    assert c.dense_s(1) == pytest.approx(SHAPE.dense_bytes_per_token("fp32") / 2 / 10e9)
    assert c.fast_compute_s(1) == pytest.approx(c.fast_bytes / 10e9)
    assert c.link_s == 0.0


def test_the_engines_bookkeeping_is_priced_by_default_at_its_measured_cost() -> None:
    """Issue 62: a profile that names no tier/miss/stream cost charges the engine's policies what
    `bench/simulate_overheads.py` measured on the nearest MoE layer shape (before: 0, an engine
    whose Python is free beside llama.cpp's C++). A profile's own figure, 0 included, replaces it."""
    from freetoken_agents.engine.simulate.engine_costs import MEASURED, MEASURED_BY, priced
    from freetoken_agents.engine.simulate.shapes import shape_for

    assert "bench/simulate_overheads.py" in MEASURED_BY and "2026-" in MEASURED_BY
    card = load_profile("rtx4090-pcie4")
    assert card.tier_overhead_us is None
    for name, key in (("mixtral-8x7b", (8, 2)), ("qwen3-30b-a3b", (128, 8)), ("deepseek-v3", (128, 8))):
        c = ExpertCosts.of(shape_for(name), card, "mxfp4")
        m = MEASURED[key]
        assert (c.tier_overhead_s, c.miss_overhead_s, c.stream_overhead_s) == pytest.approx(
            (m.tier_us * 1e-6, m.miss_us * 1e-6, m.stream_us * 1e-6)
        )
    assert ExpertCosts.of(SHAPE, _profile("cpu"), "fp32").tier_overhead_s == MEASURED[(8, 2)].tier_us * 1e-6
    free = dataclasses.replace(card, tier_overhead_us=0.0, stream_overhead_us=5.0)
    c = ExpertCosts.of(shape_for("mixtral-8x7b"), free, "mxfp4")
    assert (c.tier_overhead_s, c.stream_overhead_s) == (0.0, pytest.approx(5e-6))
    assert c.miss_overhead_s == pytest.approx(MEASURED[(8, 2)].miss_us * 1e-6)
    assert (
        "'rtx4090-pcie4''s tier/stream; the rest: Mixtral" in priced(shape_for("mixtral-8x7b"), free).source
    )


def test_only_the_engines_policies_pay_its_bookkeeping_and_the_output_says_so(capsys) -> None:
    from freetoken_agents.cli import main
    from freetoken_agents.engine.simulate.shapes import shape_for
    from freetoken_agents.engine.simulate.simulator import simulate
    from freetoken_agents.engine.simulate.synthetic import QWEN3_30B_A3B, preset_trace

    shape, card = shape_for("qwen3-30b-a3b"), load_profile("rtx4090-pcie4")
    trace = preset_trace(QWEN3_30B_A3B, tokens=4, seed=0)
    fast = shape.total_expert_bytes("mxfp4") // 4
    free = dataclasses.replace(card, tier_overhead_us=0.0, miss_overhead_us=0.0, stream_overhead_us=0.0)
    runs = [
        simulate(trace, shape, p, fast_bytes=fast, codec="mxfp4", policies=("qstar", "static"))
        for p in (card, free)
    ]
    priced_run, free_run = ({r.policy: r.tokens_per_s for r in run.results} for run in runs)
    assert priced_run["static"] == free_run["static"]
    assert priced_run["qstar"] < free_run["qstar"]
    assert runs[0].engine_costs["charged"] == ["qstar"] and runs[0].engine_costs["miss_us"] == 34.7
    argv = ["simulate", "--synthetic", "qwen3-30b-a3b", "--tokens", "4", "--hardware", "rtx4090-pcie4"]
    argv += ["--codec", "mxfp4", "--fast-mem", "0.25"]
    assert main([*argv, "--policies", "qstar,static"]) == 0
    out = capsys.readouterr().out
    assert "engine costs priced for qstar: 68.9 us a tiered MoE layer, 34.7 us a tier-1 miss" in out
    assert main([*argv, "--policies", "static"]) == 0
    assert "engine costs priced" not in capsys.readouterr().out


def _write(path: Path, doc: dict) -> Path:
    path.write_text(
        "".join(f"{k} = " + (f'"{v}"\n' if isinstance(v, str) else f"{v!r}\n") for k, v in doc.items())
    )
    return path


def test_toml_without_optional_keys(tmp_path: Path) -> None:
    p = load_profile(_write(tmp_path / "old.toml", {"name": "old", "device": "cpu", **REQUIRED}))
    assert (p.layer_overhead_us, p.expert_overhead_us, p.tier_overhead_us) == (0.0, 0.0, None)
    assert (
        load_profile(_write(tmp_path / "t.toml", {"name": "t", "device": "cpu", **REQUIRED}))
        .to_toml()
        .count("overhead_us")
        == 2
    )  # layer and expert; the engine's costs left out read back as left out
    full = HardwareProfile(name="new", device="cpu", **REQUIRED, **OVERHEADS)  # type: ignore[arg-type]
    assert "tier_overhead_us = 50.0" in full.to_toml()
    assert (
        load_profile(_write(tmp_path / "new.toml", {"name": "new", "device": "cpu", **REQUIRED, **OVERHEADS}))
        == full
    )
    f = tmp_path / "rt.toml"
    f.write_text(full.to_toml())
    assert load_profile(f) == full
    bad = _write(tmp_path / "bad.toml", {"name": "b", "device": "cpu", **REQUIRED, "tier_overhead_us": -1.0})
    with pytest.raises(ProfileError, match="key 'tier_overhead_us' must be >= 0"):
        load_profile(bad)


def test_a_tiered_replay_charges_each_tier1_miss_its_overhead() -> None:
    """miss_overhead_us: q*'s decision and the tier moves around each expert outside tier 1."""
    from freetoken_agents.engine.memory.routing_trace import group_steps
    from freetoken_agents.engine.simulate.replay import TieredReplay
    from freetoken_agents.engine.simulate.shapes import shape_for
    from freetoken_agents.engine.simulate.synthetic import MIXTRAL_8X7B, preset_trace

    shape = shape_for("mixtral-8x7b")
    steps = group_steps(preset_trace(MIXTRAL_8X7B, tokens=6, seed=0))
    base = load_profile("rtx4090-pcie4")
    costly = dataclasses.replace(base, miss_overhead_us=1000.0)
    budget = shape.total_expert_bytes("mxfp4") // 4

    def run(profile):
        replay = TieredReplay(shape, profile, codec="mxfp4", fast_bytes=budget, host_bytes=None)
        return replay.run(steps)

    cheap, slow = run(base), run(costly)
    assert slow.fast_misses > 0
    assert slow.seconds > cheap.seconds + 0.5 * slow.fast_misses * 1e-3  # at least half of them serial


def test_a_tiered_replay_charges_the_tier_moves_to_streams_only() -> None:
    """stream_overhead_us: what a STREAM's promotion, eviction and demotion add to a miss. The
    per-layer LRU streams every miss, so each pays it; q* computes most misses where their weights
    are, so the same cost per STREAM slows it less than the same cost on every miss."""
    from freetoken_agents.engine.memory.routing_trace import group_steps
    from freetoken_agents.engine.simulate.replay import TieredReplay
    from freetoken_agents.engine.simulate.shapes import shape_for
    from freetoken_agents.engine.simulate.synthetic import MIXTRAL_8X7B, preset_trace

    shape = shape_for("mixtral-8x7b")
    steps = group_steps(preset_trace(MIXTRAL_8X7B, tokens=6, seed=0))
    # A link fast enough that the copies do not hide the CPU's bookkeeping beside them.
    base = dataclasses.replace(load_profile("rtx4090-pcie4"), link_gbps=2000.0)
    budget = shape.total_expert_bytes("mxfp4") // 2

    def run(placement: str, **costs: float):
        profile = dataclasses.replace(base, **costs)
        replay = TieredReplay(
            shape, profile, codec="mxfp4", fast_bytes=budget, host_bytes=None, placement=placement
        )
        return replay.run(steps)

    lru, lru_slow = run("layer-lru"), run("layer-lru", stream_overhead_us=1000.0)
    assert lru_slow.fast_misses > 0
    assert lru_slow.seconds > lru.seconds + 0.5 * lru_slow.fast_misses * 1e-3
    per_miss, per_stream = run("qstar", miss_overhead_us=1000.0), run("qstar", stream_overhead_us=1000.0)
    assert 0 < per_stream.decisions["stream"] < per_stream.fast_misses
    assert per_stream.seconds < per_miss.seconds


def test_a_demand_copy_starts_after_the_decision_that_asked_for_it() -> None:
    """A STREAM's copy is issued once q* has decided and the tier moves are booked, as the live
    engine issues it: the CPU's bookkeeping does not hide behind a copy that started at the
    layer's start (before, 1 ms of it per miss left the per-layer LRU's PCIe 4 replay unchanged)."""
    from freetoken_agents.engine.memory.routing_trace import group_steps
    from freetoken_agents.engine.simulate.replay import TieredReplay
    from freetoken_agents.engine.simulate.shapes import shape_for
    from freetoken_agents.engine.simulate.synthetic import MIXTRAL_8X7B, preset_trace

    shape = shape_for("mixtral-8x7b")
    steps = group_steps(preset_trace(MIXTRAL_8X7B, tokens=6, seed=0))
    base = load_profile("rtx4090-pcie4")
    budget = shape.total_expert_bytes("mxfp4") // 2

    def run(profile):
        replay = TieredReplay(
            shape, profile, codec="mxfp4", fast_bytes=budget, host_bytes=None, placement="layer-lru"
        )
        return replay.run(steps)

    cheap, slow = run(base), run(dataclasses.replace(base, stream_overhead_us=1000.0))
    assert slow.fast_misses > 0
    assert slow.seconds > cheap.seconds + 0.5 * slow.fast_misses * 1e-3


def test_int8_and_mxfp4_experts_on_the_cpu_run_at_the_measured_kernel_rates() -> None:
    """A profile's `host_int8_gbps` / `host_mxfp4_gbps` (the engine's CPU kernels, measured by
    `measure_profile`) price int8 / MXFP4 experts on the CPU; 0 (built-ins) reads them at
    host_mem_gbps. The CPU decodes MXFP4 before its matmul: ~0.3 GB/s where fp32 reads ~27."""
    plain = _profile("cuda")
    rated = _profile("cuda", host_int8_gbps=2.5, host_mxfp4_gbps=0.5)
    mx, mx_rated = ExpertCosts.of(SHAPE, plain, "mxfp4"), ExpertCosts.of(SHAPE, rated, "mxfp4")
    assert mx.host_compute_s(1) == pytest.approx(mx.stored_bytes / 10e9)
    assert mx_rated.host_compute_s(1) == pytest.approx(mx.stored_bytes / 0.5e9)
    assert mx_rated.fast_compute_s(1) == mx.fast_compute_s(1)  # the GPU's kernel: not the CPU's rate
    # A CPU profile: tier 1 (the same CPU) computes int8 at the int8 rate too; fp32 is unchanged.
    cpu = _profile("cpu", device_lowp_tflops=1e3, host_int8_gbps=2.5)
    q = ExpertCosts.of(SHAPE, cpu, "int8")
    assert q.fast_compute_s(1) == q.host_compute_s(1) == pytest.approx(q.stored_bytes / 2.5e9)
    f = ExpertCosts.of(SHAPE, cpu, "fp32")
    assert f.host_compute_s(1) == pytest.approx(f.stored_bytes / 10e9)
    with pytest.raises(ProfileError, match="host_mxfp4_gbps"):
        _profile("cpu", host_mxfp4_gbps=-1.0)
