"""Simulator model shapes (`engine/simulate/shapes.py`) and hardware profiles (`profiles.py`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tiny_models import ARCHS, build_tiny_model, safetensors_layout, saved_config

from freetoken_agents.engine.adapters import adapter_for
from freetoken_agents.engine.checkpoint import config_from_dict
from freetoken_agents.engine.errors import EngineError
from freetoken_agents.engine.ftw.codecs import encode
from freetoken_agents.engine.memory.routing_trace import RoutingRecord, RoutingTraceError
from freetoken_agents.engine.simulate import profiles as profiles_module
from freetoken_agents.engine.simulate.profiles import (
    BUILTIN_PROFILES,
    HardwareProfile,
    ProfileError,
    load_profile,
)
from freetoken_agents.engine.simulate.shapes import (
    BUILTIN_CONFIGS,
    CODEC_ALIASES,
    ModelShape,
    shape_for,
    shape_from_config,
    shape_from_spec,
)
from freetoken_agents.engine.simulate.trace_fit import check_trace_fits, trace_footprint

# ---- built-in models against published facts ----------------------------------------------------

# name -> (layers, MoE layers, experts, top-k, hidden, expert intermediate, total params, active params)
PUBLISHED = {
    "mixtral-8x7b": (32, 32, 8, 2, 4096, 14336, 46.7e9, 12.9e9),
    "qwen3-30b-a3b": (48, 48, 128, 8, 2048, 768, 30.5e9, 3.3e9),
    "qwen3-235b-a22b": (94, 94, 128, 8, 4096, 1536, 235e9, 22e9),
    "deepseek-v3": (61, 58, 256, 8, 7168, 2048, 671e9, 37e9),
    # OpenAI's active counts leave out the embedding table (0.58B): ours include it
    "gpt-oss-20b": (24, 24, 32, 4, 2880, 2880, 20.9e9, 3.6e9 + 0.58e9),
    "gpt-oss-120b": (36, 36, 128, 4, 2880, 2880, 116.8e9, 5.1e9 + 0.58e9),
    "olmoe-1b-7b": (16, 16, 64, 8, 2048, 1024, 6.9e9, 1.3e9),
}


def test_every_builtin_has_published_facts() -> None:
    assert set(PUBLISHED) == set(BUILTIN_CONFIGS)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_builtin_shape_matches_published_sizes(name: str) -> None:
    layers, moe_layers, experts, top_k, hidden, inter, total, active = PUBLISHED[name]
    s = shape_for(name)
    assert (s.num_layers, len(s.moe_layers), s.num_experts, s.top_k) == (layers, moe_layers, experts, top_k)
    assert (s.hidden, s.intermediate, s.gated) == (hidden, inter, True)
    assert s.total_params() == pytest.approx(total, rel=0.02)
    assert s.active_params_per_token() == pytest.approx(active, rel=0.05)
    assert s.expert_bytes("bf16") == 2 * s.expert_params()
    assert s.total_expert_bytes("bf16") == len(s.moe_layers) * experts * s.expert_bytes("bf16")
    assert s.expert_flops_per_token() == 2 * 3 * hidden * inter
    assert s.routed_bytes_per_token() == len(s.moe_layers) * top_k * s.expert_bytes()


def test_mixtral_expert_bytes_per_codec() -> None:
    s = shape_for("mixtral-8x7b")
    h, i = 4096, 14336
    n = 3 * h * i
    assert s.moe_layers == tuple(range(32))
    assert s.expert_bytes("bf16") == n * 2
    assert s.expert_bytes("fp32") == n * 4
    # fp8: one fp32 scale_inv per 128x128 block of gate_up [2I, H] and down [H, I]
    assert s.expert_bytes("fp8") == n + 4 * ((2 * i // 128) * (h // 128) + (h // 128) * (i // 128))
    assert s.expert_bytes("fp8") == s.expert_bytes("fp8_e4m3")
    # int8: one fp32 scale per output row
    assert s.expert_bytes("int8") == n + 4 * (2 * i + h)
    # mxfp4: 16 bytes of E2M1 codes + one E8M0 byte per 32 weights
    assert s.expert_bytes("mxfp4") == n // 32 * 17
    assert s.expert_bytes("mxfp4") / n == pytest.approx(0.5 + 1 / 32)
    with pytest.raises(ValueError, match="unknown codec 'fp4'.*mxfp4"):
        s.expert_bytes("fp4")


def test_qwen3_30b_a3b_and_deepseek_v3_structure() -> None:
    q = shape_for("qwen3-30b-a3b")
    assert (q.hidden, q.intermediate, q.vocab_size) == (2048, 768, 151936)
    assert q.lm_head_bytes() == 151936 * 2048 * 2  # 622 MB, FACTS.md
    d = shape_for("deepseek-v3")
    assert d.moe_layers == tuple(range(3, 61))  # first_k_dense_replace = 3
    spec = adapter_for("deepseek_v3").build_spec(config_from_dict(BUILTIN_CONFIGS["deepseek-v3"]))
    moe = spec.layers[3].moe
    assert moe is not None and (moe.shared, moe.shared_intermediate_size) == ("plain", 2048)
    # the router and its correction bias stay fp32 whatever the codec
    assert d.fp32_elems == 58 * (256 * 7168 + 256)
    assert d.dense_bytes_per_token("fp8") < d.dense_bytes_per_token("bf16")


def test_gpt_oss_mxfp4_experts_with_bf16_biases() -> None:
    s = shape_for("gpt-oss-20b")
    h = i = 2880
    assert s.expert_bias
    weights = 3 * h * i
    assert s.expert_params() == weights + 2 * i + h
    assert s.expert_bytes("mxfp4") == weights // 32 * 17 + 2 * (2 * i + h)
    assert s.expert_bytes("fp32") == 4 * s.expert_params()
    # the FTW block: 64-byte header, parts aligned to 64 bytes, rounded up to 4 KiB
    block = s.expert_block_bytes("mxfp4")
    assert block % 4096 == 0 and 0 <= block - s.expert_bytes("mxfp4") - 64 < 4096 + 4 * 64


def test_codec_aliases_match_convert() -> None:
    from freetoken_agents.engine.loading.convert import QUANT_CODECS

    assert CODEC_ALIASES == QUANT_CODECS


def test_shape_for_unknown_name_lists_builtins() -> None:
    with pytest.raises(EngineError, match="unknown model 'llama-moe'.*mixtral-8x7b.*olmoe-1b-7b") as err:
        shape_for("llama-moe")
    assert "\n" not in str(err.value)


def test_shape_from_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(EngineError, match="cannot read model config"):
        shape_from_config(bad)
    with pytest.raises(EngineError, match="no 'model_type'"):
        shape_from_config({"hidden_size": 8})
    with pytest.raises(EngineError, match="not supported"):
        shape_from_config({"model_type": "llama"})


# ---- tiny checkpoints: the shape counts exactly what is stored -----------------------------------


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shapes")
    return {arch: build_tiny_model(arch, root / arch, with_tokenizer=False) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_shape_matches_spec_and_stored_tensors(arch: str, tiny_folders: dict[str, Path]) -> None:
    folder = tiny_folders[arch]
    raw = saved_config(folder)
    spec = adapter_for(raw["model_type"]).build_spec(config_from_dict(raw))
    shape = shape_for(folder)
    assert shape == shape_from_config(folder / "config.json") == shape_from_config(raw)
    assert shape == shape_from_spec(spec, name=raw["model_type"])
    assert list(shape.moe_layers) == spec.moe_layers()
    moe = spec.layers[spec.moe_layers()[0]].moe
    assert moe is not None
    assert (shape.num_experts, shape.top_k, shape.intermediate) == (
        moe.num_experts,
        moe.top_k,
        moe.intermediate_size,
    )
    assert (shape.hidden, shape.num_layers, shape.vocab_size) == (
        spec.hidden_size,
        spec.num_layers,
        spec.vocab_size,
    )
    # every stored parameter is counted, once
    stored = sum(math.prod(shp) for shp, _ in safetensors_layout(folder).values())
    assert shape.total_params() == stored
    # fp32 dense bytes per token: all but routed experts and the embedding table, plus one row
    experts = len(shape.moe_layers) * shape.num_experts * shape.expert_params()
    embedding = shape.vocab_size * shape.hidden if not shape.tie_word_embeddings else 0
    assert shape.dense_bytes_per_token("fp32") == 4 * (stored - experts - embedding + shape.hidden)


@pytest.mark.parametrize("codec", ["bf16", "fp8_e4m3", "int8", "mxfp4", "int8_b32", "uint4_b32"])
def test_expert_bytes_equal_encoded_bytes(codec: str) -> None:
    raw = {**BUILTIN_CONFIGS["mixtral-8x7b"], "hidden_size": 256, "intermediate_size": 160}
    raw.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    shape = shape_from_config(raw)
    h, i = 256, 160
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2 * i, h, generator=gen), torch.randn(h, i, generator=gen)]
    assert shape.expert_bytes(codec) == sum(encode(t, codec).nbytes for t in tensors)


def test_mxfp4_falls_back_to_bf16_for_odd_input_dims() -> None:
    raw = {**BUILTIN_CONFIGS["mixtral-8x7b"], "hidden_size": 64, "intermediate_size": 48}
    raw.update(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    shape = shape_from_config(raw)
    # gate_up [96, 64] in mxfp4; down [64, 48] has an input dim 48 (not a multiple of 32): bf16
    assert shape.expert_bytes("mxfp4") == 96 * 64 // 32 * 17 + 64 * 48 * 2


# ---- routing traces against a shape --------------------------------------------------------------


def _records(layers: list[int], experts: tuple[int, ...]) -> list[RoutingRecord]:
    w = tuple(1.0 / len(experts) for _ in experts)
    return [RoutingRecord(0, t, layer, experts, w, "decode") for t in range(2) for layer in layers]


def test_trace_that_fits() -> None:
    s = shape_for("deepseek-v3")
    fp = trace_footprint(_records(list(range(3, 61)), (0, 255, 7, 8, 9, 10, 11, 12)))
    assert (fp.max_expert, fp.top_k, fp.min_top_k) == (255, 8, 8)
    check_trace_fits(s, fp.layers, fp.max_expert, fp.top_k)
    check_trace_fits(s, [5, 6], 3, 8, all_layers=False)


def test_trace_mismatches_name_what_differs() -> None:
    s = shape_for("deepseek-v3")
    moe = list(range(3, 61))
    with pytest.raises(
        RoutingTraceError, match=r"layers 0-2 are not MoE layers of deepseek-v3 \(MoE layers: 3-60\)"
    ):
        check_trace_fits(s, list(range(61)), 10, 8)
    with pytest.raises(RoutingTraceError, match="MoE layers 40,59-60 of deepseek-v3 have no records"):
        check_trace_fits(s, [x for x in moe if x not in (40, 59, 60)], 10, 8)
    with pytest.raises(RoutingTraceError, match="expert id 256 >= deepseek-v3's 256 experts"):
        check_trace_fits(s, moe, 256, 8)
    with pytest.raises(RoutingTraceError, match="top-2 routing where deepseek-v3 routes top-8") as err:
        check_trace_fits(s, moe, 10, 2)
    assert "\n" not in str(err.value)
    fp = trace_footprint(_records(list(range(32)), (0, 1)))
    with pytest.raises(RoutingTraceError, match="layers 0-2 are not.*; expert id.*; top-2 routing"):
        check_trace_fits(s, fp.layers, 300, fp.top_k)
    with pytest.raises(RoutingTraceError, match="empty"):
        trace_footprint([])


# ---- hardware profiles ---------------------------------------------------------------------------


def test_builtin_profiles() -> None:
    assert set(BUILTIN_PROFILES) == {"rtx4090-pcie4", "rtx5090-pcie5", "h200", "cpu-ddr5"}
    for name, p in BUILTIN_PROFILES.items():
        assert load_profile(name) is p and p.name == name
    gpu = load_profile("rtx4090-pcie4")
    assert gpu.device == "cuda" and gpu.device_mem_bytes == 24 * 1024**3
    assert gpu.link_gbps == 25.0 and gpu.device_mem_gbps == 1008.0
    h200 = load_profile("h200")
    assert (h200.link_gbps, h200.device_mem_gbps) == (55.0, 4300.0)  # measured, FACTS.md
    assert h200.link_seconds(55 * 10**9) == pytest.approx(1.0 + 1e-5)
    cpu = load_profile("cpu-ddr5")
    assert cpu.device == "cpu" and cpu.device_mem_bytes == cpu.host_mem_bytes


def test_profile_toml_round_trip(tmp_path: Path) -> None:
    for p in BUILTIN_PROFILES.values():
        f = tmp_path / f"{p.name}.toml"
        f.write_text(p.to_toml())
        assert load_profile(f) == p
        assert load_profile(str(f)) == p


def test_docstring_example_profile(tmp_path: Path) -> None:
    doc = profiles_module.__doc__ or ""
    start = doc.index('    name = "my-4090"')
    end = doc.index("    cpu_cores = 16") + len("    cpu_cores = 16")
    f = tmp_path / "my.toml"
    f.write_text("\n".join(line[4:] for line in doc[start:end].splitlines()) + "\n")
    p = load_profile(f)
    assert p.name == "my-4090" and p.host_mem_bytes == 128 * 1024**3
    assert isinstance(p.link_gbps, float)


def _fields() -> dict:
    return dict(
        name="x",
        device="cuda",
        link_gbps=25,
        link_latency_us=10.0,
        device_mem_gbps=1000.0,
        device_mem_bytes=1 << 30,
        device_bf16_tflops=100.0,
        device_lowp_tflops=200.0,
        host_mem_gbps=60.0,
        host_mem_bytes=1 << 34,
        disk_gbps=5.0,
        cpu_gflops=500.0,
        cpu_cores=8,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"link_gbs": 3.0}, "unknown key 'link_gbs'"),
        ({"disk_gbps": None}, "missing key 'disk_gbps'"),
        ({"link_gbps": "fast"}, "key 'link_gbps' must be a number, got 'fast'"),
        ({"cpu_cores": 8.5}, "key 'cpu_cores' must be an integer, got 8.5"),
        ({"device_mem_bytes": True}, "key 'device_mem_bytes' must be an integer"),
        ({"host_mem_gbps": 0}, "key 'host_mem_gbps' must be positive, got 0"),
        ({"disk_gbps": -1.5}, "key 'disk_gbps' must be positive, got -1.5"),
        ({"device": "tpu"}, "key 'device' must be one of cuda, cpu, got 'tpu'"),
        ({"name": ""}, "key 'name' must be a non-empty string"),
    ],
)
def test_malformed_profile_names_file_and_key(tmp_path: Path, change: dict, message: str) -> None:
    doc = {**_fields(), **change}
    f = tmp_path / "bad.toml"
    lines = [
        f"{k} = " + (f'"{v}"' if isinstance(v, str) else str(v).lower())
        for k, v in doc.items()
        if v is not None
    ]
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ProfileError, match=f"^{f}(:[0-9]+)?: .*{message}") as err:  # :line of a key
        load_profile(f)
    assert isinstance(err.value, ValueError) and isinstance(err.value, EngineError)
    assert "\n" not in str(err.value)


def test_unreadable_profiles(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="unknown hardware profile 'rtx3090'.*rtx4090-pcie4.*cpu-ddr5"):
        load_profile("rtx3090")
    f = tmp_path / "broken.toml"
    f.write_text("name = \n")
    with pytest.raises(ProfileError, match="broken.toml: not valid TOML"):
        load_profile(f)


def test_profile_constructor_validates() -> None:
    assert HardwareProfile(**_fields()).link_gbps == 25.0
    with pytest.raises(ProfileError, match="profile 'x': key 'cpu_cores' must be positive"):
        HardwareProfile(**{**_fields(), "cpu_cores": 0})


def test_shapes_are_frozen() -> None:
    s = shape_for("olmoe-1b-7b")
    assert isinstance(s, ModelShape)
    with pytest.raises(AttributeError):
        s.top_k = 2  # type: ignore[misc]
