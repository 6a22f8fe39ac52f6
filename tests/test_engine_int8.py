"""Int8 weight-only compute (engine/kernels/int8.py): accuracy against the fp32 engine, the fused kernel
against the dequantize path, fallbacks, and bad options.

Stated tolerances (logit error = max |diff| / max |logit| of the reference at one position):
- int8 experts vs fp32 engine: median over positions < 1e-2 (measured 2-5e-3 on the tiny models;
  the maximum is not bounded this way: a routing flip on a near-tie changes a whole expert);
- int8 experts + attention + lm_head: median < 2e-2 (measured ~9e-3);
- fused kernel vs dequantize path, same int8 weights: max < 1e-2 (bf16 activations and kernel
  output, 2^-9 relative each; measured 1-4e-3);
- dequantize path vs the codec's decode + F.linear: bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_model

from freetoken_agents.engine import Engine, EngineError
from freetoken_agents.engine.errors import FTWFormatError
from freetoken_agents.engine.ftw.codecs import decode, encode
from freetoken_agents.engine.kernels import int8 as int8_mod
from freetoken_agents.engine.kernels.int8 import (
    Int8Linear,
    dequant_linear,
    int8_linear,
    kernel_available,
    kernel_fits,
)
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.loading.ftw_load import load_ftw
from freetoken_agents.engine.model.expert_tensors import canonical_expert

ARCHS = ("mixtral", "qwen3_moe")
IDS = torch.randint(5, 400, (20,), generator=torch.Generator().manual_seed(3)).tolist()
PREFIX = 12


def _run(engine: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits [PREFIX, V] and teacher-forced decode logits [len(IDS) - PREFIX, V]."""
    with engine.new_session() as s:
        prefill = s.prefill(IDS[:PREFIX])
        decoded = torch.stack([s.decode(t) for t in IDS[PREFIX:]])
    return prefill, decoded


def _errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per-position max |diff| / max |logit| of `want`."""
    return (got - want).abs().amax(-1) / want.abs().amax(-1)


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    cache: dict[tuple[str, str], Engine] = {}

    def get(arch: str, mode: str) -> Engine:
        if (arch, mode) not in cache:
            opts = {
                "fp32": {},
                "int8": {"expert_quant": "int8"},
                "all": {"expert_quant": "int8", "dense_quant": ("attention", "lm_head")},
            }[mode]
            cache[(arch, mode)] = Engine.from_pretrained(tiny_checkpoint(arch), **opts)
        return cache[(arch, mode)]

    return get


@pytest.fixture(scope="module")
def runs(engines):
    """`runs(arch, mode)` -> cached `_run` of `engines(arch, mode)` (default kernel settings)."""
    cache: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(arch: str, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        if (arch, mode) not in cache:
            cache[(arch, mode)] = _run(engines(arch, mode))
        return cache[(arch, mode)]

    return get


def test_kernel_is_available_here():
    assert kernel_available(), "torch._weight_int8pack_mm missing or wrong in this torch build"


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_experts_match_fp32_engine(arch, engines, runs, kernel_calls):
    ref, q = engines(arch, "fp32"), engines(arch, "int8")
    w = q.experts.get(*q.experts.keys()[0])
    assert w.gate_up.dtype == w.down.dtype == torch.int8 and w.gate_up_scale is not None
    w32 = ref.experts.get(*ref.experts.keys()[0])
    assert w.nbytes < 0.3 * w32.nbytes  # int8 + scales, no float copy
    (p_ref, d_ref), (p_q, d_q) = runs(arch, "fp32"), _run(q)
    assert kernel_calls, "decode did not use the fused int8 kernel"
    for got, want in ((p_q, p_ref), (d_q, d_ref)):
        err = _errors(got, want)
        assert 0 < err.median() < 1e-2, err


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_experts_attention_and_head_match_fp32_engine(arch, engines, runs):
    ref, q = engines(arch, "fp32"), engines(arch, "all")
    assert isinstance(q.model.lm_head, Int8Linear)
    assert isinstance(q.model.layers[0].self_attn.q_proj, Int8Linear)
    (p_ref, d_ref), (p_q, d_q) = runs(arch, "fp32"), runs(arch, "all")
    for got, want in ((p_q, p_ref), (d_q, d_ref)):
        err = _errors(got, want)
        assert 0 < err.median() < 2e-2, err
    assert q.model_fingerprint != ref.model_fingerprint
    assert q.describe()["dense_quant"] == ["attention", "lm_head"]


@pytest.mark.parametrize("arch", ARCHS)
def test_kernel_path_matches_dequantize_path(arch, engines, runs, monkeypatch):
    q = engines(arch, "all")
    _, with_kernel = runs(arch, "all")
    monkeypatch.setattr(int8_mod, "KERNEL_MAX_TOKENS", 0)
    _, dequantized = _run(q)
    err = _errors(with_kernel, dequantized)
    assert 0 < err.max() < 1e-2, err


@pytest.mark.parametrize("tokens", [1, 3, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_kernel_vs_dequantize(tokens, dtype, kernel_calls):
    g = torch.Generator().manual_seed(tokens)
    enc = encode(torch.randn(40, 64, generator=g), "int8")
    q, scale = enc.parts["weight"], enc.parts["scale"]
    x = torch.randn(tokens, 64, generator=g).to(dtype)
    bias = torch.randn(40, generator=g).to(dtype)
    want = torch.nn.functional.linear(x, decode(enc, dtype), bias)
    assert torch.equal(dequant_linear(x, q, scale, bias), want)  # exactly the codec's decode
    got = int8_linear(x, q, scale, bias, use_kernel=True)
    assert kernel_calls == [(40, 64)] and got.dtype == dtype and got.shape == (tokens, 40)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-2
    # Automatic choice: the kernel only for few tokens.
    int8_linear(x, q, scale, bias)
    assert len(kernel_calls) == (2 if tokens <= int8_mod.KERNEL_MAX_TOKENS else 1)


def test_shapes_the_kernel_cannot_take_fall_back(kernel_calls):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 24, generator=g)
    enc = encode(torch.randn(8, 24, generator=g), "int8")  # in features not a multiple of 16
    q, scale = enc.parts["weight"], enc.parts["scale"]
    assert not kernel_fits(q)
    assert torch.equal(int8_linear(x, q, scale, use_kernel=True), x @ decode(enc).T)
    wide = encode(torch.randn(8, 64, generator=g), "int8").parts["weight"]
    assert kernel_fits(wide) and not kernel_fits(wide[:, :32])  # a strided view: not contiguous
    assert kernel_calls == []


def test_dequantize_in_row_blocks_matches_one_block(monkeypatch):
    g = torch.Generator().manual_seed(1)
    enc = encode(torch.randn(50, 32, generator=g), "int8")
    x, bias = torch.randn(7, 32, generator=g), torch.randn(50, generator=g)
    whole = dequant_linear(x, enc.parts["weight"], enc.parts["scale"], bias)
    monkeypatch.setattr(int8_mod, "DEQUANT_BLOCK", 12 * 32)  # 12 rows per block, 5 blocks
    blocked = dequant_linear(x, enc.parts["weight"], enc.parts["scale"], bias)
    torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=1e-6)


def test_engine_falls_back_where_the_kernel_does_not_fit(tmp_path, kernel_calls):
    # intermediate 24: gate_up [48, 64] takes the kernel, down [64, 24] (K=24) cannot.
    path = build_tiny_model("mixtral", tmp_path / "m24", with_tokenizer=False, intermediate_size=24)
    ref, q = Engine.from_pretrained(path), Engine.from_pretrained(path, expert_quant="int8")
    (p_ref, d_ref), (p_q, d_q) = _run(ref), _run(q)
    assert (48, 64) in kernel_calls and (64, 24) not in kernel_calls
    assert _errors(d_q, d_ref).median() < 1e-2 and _errors(p_q, p_ref).median() < 1e-2


def test_without_the_kernel_everything_dequantizes(engines, monkeypatch, kernel_calls):
    q = engines("mixtral", "all")
    monkeypatch.setattr(int8_mod, "_KERNEL_OK", False)
    _, without = _run(q)
    monkeypatch.setattr(int8_mod, "KERNEL_MAX_TOKENS", 0)
    _, dequantized = _run(q)
    assert kernel_calls == [] and torch.equal(without, dequantized)


def test_ftw_int8_file_runs_int8_and_matches_quantize_at_load(tiny_checkpoint, tmp_path, runs, monkeypatch):
    path = tmp_path / "q.ftw"
    convert_checkpoint(
        tiny_checkpoint("qwen3_moe"), path, quant="int8", progress=False, dense_dtype=torch.float32
    )
    auto = Engine.from_pretrained(path)  # expert_quant="auto": int8 blocks stay int8
    none = Engine.from_pretrained(path, expert_quant="none")
    w_auto = auto.experts.get(0, 0)
    assert w_auto.gate_up.dtype == torch.int8 and none.experts.get(0, 0).gate_up.dtype == torch.float32
    # Same bits as quantizing the HF checkpoint at load (up to fp32 rounding of dense matmuls).
    (p_a, d_a), (p_h, d_h) = _run(auto), runs("qwen3_moe", "int8")
    assert _errors(p_a, p_h).max() < 1e-5 and _errors(d_a, d_h).max() < 1e-5
    # The dequantize path is exactly the old decode-to-fp32 path.
    monkeypatch.setattr(int8_mod, "KERNEL_MAX_TOKENS", 0)
    assert all(torch.equal(a, b) for a, b in zip(_run(auto), _run(none), strict=True))


def test_auto_mode_leaves_float_checkpoints_unchanged(tiny_checkpoint, engines, runs):
    path = tiny_checkpoint("mixtral")
    ref = engines("mixtral", "fp32")
    none = Engine.from_pretrained(path, expert_quant="none")
    assert ref.experts.get(0, 0).gate_up.dtype == torch.float32 and not ref.experts.get(0, 0).is_quantized
    assert all(torch.equal(a, b) for a, b in zip(runs("mixtral", "fp32"), _run(none), strict=True))


def test_split_gate_up_int8_scales_are_joined():
    q = torch.ones(4, 8, dtype=torch.int8)
    s_gate, s_up = torch.full((4,), 2.0), torch.full((4,), 3.0)
    out = canonical_expert({"gate": q, "up": q, "gate_scale": s_gate, "up_scale": s_up, "down": q.T.clone()})
    assert out["gate_up"].shape == (8, 8) and torch.equal(out["gate_up_scale"], torch.cat([s_gate, s_up]))
    with pytest.raises(FTWFormatError, match="both be int8"):
        canonical_expert({"gate": q, "up": q, "gate_scale": s_gate, "down": q.T.clone()})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"expert_quant": "int4"}, "unknown expert_quant 'int4'; expected one of auto, int8, compact, none"),
        ({"dense_quant": ("mlp",)}, "unknown dense_quant parts ['mlp']"),
        ({"dense_quant": "lm_head"}, "must be a sequence of part names"),
    ],
)
def test_unknown_quant_options_are_refused(tiny_checkpoint, kwargs, message):
    with pytest.raises(EngineError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Engine.from_pretrained(tiny_checkpoint("mixtral"), **kwargs)


def test_unknown_expert_quant_is_refused_for_ftw_before_reading(tmp_path):
    with pytest.raises(EngineError, match="unknown expert_quant 'fp8'") as ei:
        load_ftw(tmp_path / "missing.ftw", expert_quant="fp8")
    assert ei.type is EngineError  # not the CheckpointError a missing file would give
