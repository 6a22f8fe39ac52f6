"""The simulator's cost model against what real setups pay (issue 62): the fit check, budgets in
the bytes tier 1 holds, llama.cpp's by-layer split, dense weights in their codec and the CPU's
share of its memory bandwidth."""

from __future__ import annotations

import dataclasses
import json

import pytest

from freetoken_agents.cli import main
from freetoken_agents.engine.simulate.fit import FitError, tier1_share_bytes
from freetoken_agents.engine.simulate.machine import ExpertCosts
from freetoken_agents.engine.simulate.profiles import load_profile
from freetoken_agents.engine.simulate.shapes import shape_for
from freetoken_agents.engine.simulate.simulator import simulate
from freetoken_agents.engine.simulate.synthetic import MIXTRAL_8X7B, QWEN3_30B_A3B, preset_trace


@pytest.fixture(scope="module")
def qwen_trace():
    return preset_trace(QWEN3_30B_A3B, tokens=6, seed=0)


def test_a_setup_that_cannot_fit_the_card_is_refused_in_one_line() -> None:
    # bf16 Mixtral with half its experts on a 24 GB card: 45 GB of fast memory alone.
    shape, card = shape_for("mixtral-8x7b"), load_profile("rtx4090-pcie4")
    trace = preset_trace(MIXTRAL_8X7B, tokens=4, seed=0)
    with pytest.raises(FitError) as e:
        simulate(trace, shape, card, fast_bytes=shape.total_expert_bytes("bf16") // 2, codec="bf16")
    msg = str(e.value)
    assert "\n" not in msg and "does not fit rtx4090-pcie4's 24.0 GiB of device memory" in msg
    assert "fast memory 42.0" in msg and "dense weights (bf16)" in msg
    # MXFP4 experts at a quarter fit: replayed.
    report = simulate(trace, shape, card, fast_bytes=shape.total_expert_bytes("mxfp4") // 4, codec="mxfp4")
    assert report.result("static").tokens_per_s > 0


def test_the_kv_cache_of_the_context_counts(qwen_trace) -> None:
    shape, card = shape_for("qwen3-30b-a3b"), load_profile("rtx4090-pcie4")
    fast = shape.total_expert_bytes("mxfp4") // 4
    simulate(qwen_trace, shape, card, fast_bytes=fast, codec="mxfp4", policies=("static",))
    with pytest.raises(FitError, match="KV of 200000 tokens"):  # 18.3 GiB of bf16 KV
        simulate(
            qwen_trace, shape, card, fast_bytes=fast, codec="mxfp4", policies=("static",), context=200_000
        )


def test_static_layers_keeps_whole_layers_on_the_device(qwen_trace) -> None:
    shape, card = shape_for("qwen3-30b-a3b"), load_profile("rtx4090-pcie4")
    layer = shape.num_experts * shape.expert_bytes("mxfp4")
    report = simulate(
        qwen_trace,
        shape,
        card,
        fast_bytes=12 * layer + layer // 2,  # 12.5 layers' experts: the half layer stays on the CPU
        codec="mxfp4",
        policies=("static", "static-layers"),
    )
    by_layer = report.result("static-layers")
    assert by_layer.cpu_experts_per_token == (48 - 12) * 8
    # llama.cpp's --n-cpu-moe, placed by nothing but layer order, runs more on the CPU than the
    # split placed by popularity at the same budget.
    assert report.result("static").cpu_experts_per_token < by_layer.cpu_experts_per_token


def test_all_experts_on_the_cpu_runs_with_no_fast_memory(qwen_trace) -> None:
    # llama.cpp -cmoe: every routed expert on the CPU, tier 1 empty.
    shape, card = shape_for("qwen3-30b-a3b"), load_profile("rtx4090-pcie4")
    report = simulate(qwen_trace, shape, card, fast_bytes=0, codec="q4_k_m", policies=("static-layers",))
    assert report.result("static-layers").cpu_experts_per_token == 48 * 8


def test_a_share_of_fast_memory_is_of_the_bytes_tier_1_holds(tmp_path, capsys) -> None:
    # On a GPU tier 1 holds int8 experts as bf16: half the experts is half the bf16 bytes.
    shape, card = shape_for("qwen3-30b-a3b"), load_profile("rtx4090-pcie4")
    assert tier1_share_bytes(shape, card, "int8", 0.25) == shape.total_expert_bytes("bf16") // 4
    argv = ["simulate", "--synthetic", "qwen3-30b-a3b", "--tokens", "4", "--hardware", "rtx4090-pcie4"]
    argv += ["--codec", "int8", "--fast-mem", "0.25", "--policies", "static", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fast_bytes"] == int(0.25 * shape.total_expert_bytes("bf16"))


def test_dense_weights_are_priced_in_their_codec() -> None:
    shape, card = shape_for("qwen3-30b-a3b"), load_profile("rtx4090-pcie4")
    bf16 = ExpertCosts.of(shape, card, "q4_k_m")
    q4 = ExpertCosts.of(shape, card, "q4_k_m", dense_codec="q4_k_m")
    assert q4.dense_layer_s == pytest.approx(bf16.dense_layer_s * 4.85 / 16, rel=0.02)
    # A GGUF expert is held and computed in its own bits (4.85 per weight for Q4_K_M).
    assert q4.fast_bytes == q4.stored_bytes == pytest.approx(shape.expert_params() * 4.85 / 8, rel=1e-3)


def test_the_cpu_reaches_its_share_of_memory_bandwidth() -> None:
    shape, card = shape_for("mixtral-8x7b"), load_profile("rtx4090-pcie4")
    full = ExpertCosts.of(shape, card, "bf16")
    half = ExpertCosts.of(shape, dataclasses.replace(card, host_efficiency=0.5), "bf16")
    assert half.host_compute_s(1) == pytest.approx(2 * full.host_compute_s(1), rel=1e-6)
    assert half.fast_compute_s(1) == full.fast_compute_s(1)  # the GPU is not the CPU
