"""Tests of the FTW weight codecs: round trips with error bounds and spec-level reference decoders."""

from __future__ import annotations

import math
import random

import pytest
import torch

from freetoken_agents.engine.ftw import codecs as C
from freetoken_agents.engine.ftw.codecs import CODECS, EncodedTensor, decode, encode, get_codec

# ---------------------------------------------------------------------------------------------
# Reference decoders written straight from the specs, with plain Python loops (small tensors only).
# ---------------------------------------------------------------------------------------------

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def ref_mxfp4_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OCP MX: value = E2M1(code) * 2**(E8M0 - 127); E8M0 255 = NaN; low nibble = even index."""
    out, nb, _ = blocks.shape
    b = blocks.tolist()
    s = scales.tolist()
    rows = []
    for r in range(out):
        row = []
        for k in range(nb):
            scale = math.nan if s[r][k] == 255 else 2.0 ** (s[r][k] - 127)
            for j in range(16):
                byte = b[r][k][j]
                row.append(E2M1[byte & 0x0F] * scale)  # element 2j
                row.append(E2M1[byte >> 4] * scale)  # element 2j + 1
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64).to(torch.float32)


def ref_e4m3fn(byte: int) -> float:
    """float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN, no inf."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp = (byte >> 3) & 0x0F
    man = byte & 0x07
    if exp == 0x0F and man == 0x07:
        return math.nan
    if exp == 0:
        return sign * (man / 8.0) * 2.0**-6
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


def ref_fp8_block_decode(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3: w[i, j] * scale_inv[i // 128, j // 128], computed in fp32."""
    out, inp = weight.shape
    w = weight.view(torch.uint8).tolist()
    s = scale_inv.tolist()
    rows = []
    for i in range(out):
        rows.append([ref_e4m3fn(w[i][j]) * s[i // 128][j // 128] for j in range(inp)])
    # A product of two fp32 values is exact in float64, so one rounding to fp32 equals fp32 math.
    return torch.tensor(rows, dtype=torch.float64).to(torch.float32)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality of float tensors (NaNs compared by position only)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    ia = a.contiguous().view(torch.int32 if a.element_size() == 4 else torch.int16)
    ib = b.contiguous().view(torch.int32 if b.element_size() == 4 else torch.int16)
    return bool(((ia == ib) | nan_a).all())


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


def test_registry() -> None:
    assert CODECS == ("fp32", "bf16", "fp8_e4m3", "int8", "mxfp4", "int8_b32", "uint4_b32")
    for name in CODECS:
        assert get_codec(name).name == name
    known = "known codecs: fp32, bf16, fp8_e4m3, int8, mxfp4, int8_b32, uint4_b32"
    with pytest.raises(ValueError, match=known):
        get_codec("nf4")


# ---------------------------------------------------------------------------------------------
# Round trips with error bounds
# ---------------------------------------------------------------------------------------------


def _weights(out: int = 200, inp: int = 320, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(out, inp, generator=g) * 0.02
    x[3, :] *= 50.0  # an outlier row
    x[:, 7] = 0.0
    return x


def test_fp32_exact() -> None:
    x = _weights()
    enc = encode(x, "fp32")
    assert torch.equal(decode(enc), x)
    b = torch.randn(17)  # 1-D (bias) works
    assert torch.equal(decode(encode(b, "fp32")), b)


def test_bf16_exact_after_cast() -> None:
    x = _weights()
    enc = encode(x, "bf16")
    assert enc.parts["weight"].dtype == torch.bfloat16
    assert torch.equal(decode(enc), x.bfloat16().float())
    xb = x.bfloat16()
    assert torch.equal(decode(encode(xb, "bf16"), torch.bfloat16), xb)
    b = torch.randn(5, dtype=torch.bfloat16)
    assert torch.equal(decode(encode(b, "bf16"), torch.bfloat16), b)


def test_fp8_round_trip_bound() -> None:
    x = _weights()
    enc = encode(x, "fp8_e4m3")
    assert enc.parts["weight"].dtype == torch.float8_e4m3fn
    assert tuple(enc.parts["scale_inv"].shape) == (2, 3)
    y = decode(enc)
    s = enc.parts["scale_inv"].repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :320]
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 in the normal range; in the subnormal range
    # the absolute error is <= half the subnormal step (2**-9 / 2), times the block scale.
    bound = (x.abs() * 2.0**-4 + s * 2.0**-10) * (1 + 1e-5)
    assert ((y - x).abs() <= bound).all()
    rel = ((y - x).norm() / x.norm()).item()
    assert rel < 0.035
    # Each block's largest magnitude maps to exactly 448 * scale_inv.
    assert torch.allclose(enc.parts["scale_inv"][0, 0], x[:128, :128].abs().max() / 448)


def test_int8_round_trip_bound() -> None:
    x = _weights()
    enc = encode(x, "int8")
    q, scale = enc.parts["weight"], enc.parts["scale"]
    assert q.dtype == torch.int8 and scale.shape == (200,)
    assert int(q.abs().max()) == 127
    y = decode(enc)
    assert ((y - x).abs() <= scale[:, None] * 0.5 * (1 + 1e-5)).all()
    assert ((y - x).norm() / x.norm()).item() < 0.01
    zero = torch.zeros(4, 64)
    assert torch.equal(decode(encode(zero, "int8")), zero)


def _mxfp4_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 spacing at each element's magnitude, times its block's 2**e."""
    out, inp = x.shape
    p = torch.ldexp(torch.ones(out, inp // 32), scales.to(torch.int32) - 127).repeat_interleave(32, 1)
    a = x.abs() / p
    half_gap = torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))
    return half_gap * p


def test_mxfp4_round_trip_bound() -> None:
    x = _weights()
    enc = encode(x, "mxfp4")
    assert tuple(enc.parts["blocks"].shape) == (200, 10, 16)
    assert tuple(enc.parts["scales"].shape) == (200, 10)
    y = decode(enc)
    assert ((y - x).abs() <= _mxfp4_bound(x, enc.parts["scales"])).all()
    assert ((y - x).norm() / x.norm()).item() < 0.13
    # Each scaled block fits: amax / 2**e <= 6 and > 3 (e is the smallest that fits).
    p = torch.ldexp(torch.ones(200, 10), enc.parts["scales"].to(torch.int32) - 127)
    amax = x.view(200, 10, 32).abs().amax(-1)
    nz = amax > 0
    assert (amax[nz] / p[nz] <= 6).all() and (amax[nz] / p[nz] > 3).all()


def test_mxfp4_exactly_representable_values_decode_exactly() -> None:
    rng = random.Random(1)
    out, inp = 16, 128
    rows = []
    for _ in range(out):
        row = []
        for _ in range(inp // 32):
            k = rng.randint(-100, 100)
            row += [rng.choice(E2M1) * 2.0**k for _ in range(32)]
        rows.append(row)
    x = torch.tensor(rows, dtype=torch.float32)
    x[0, :32] = 0.0  # an all-zero block
    x[1, :32] = -0.0
    y = decode(encode(x, "mxfp4"))
    assert bits_equal(y, x)


def test_mxfp4_ties_to_even_code() -> None:
    x = torch.zeros(1, 32)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x[0, : len(ties)] = torch.tensor(ties)
    x[0, 7 : 7 + len(ties)] = -torch.tensor(ties)
    x[0, 20:24] = torch.tensor([0.3, 5.1, 2.9, 6.0])  # non-ties; 6.0 sets e = 0
    y = decode(encode(x, "mxfp4"))[0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert y[:7].tolist() == want
    assert y[7:14].tolist() == [-w for w in want]
    assert y[20:24].tolist() == [0.5, 6.0, 3.0, 6.0]


def test_mxfp4_all_zero_and_tiny_blocks() -> None:
    x = torch.zeros(2, 64)
    x[1, 32:] = 1e-42  # subnormal fp32 values: exponent clamps to -127, no NaN or inf
    enc = encode(x, "mxfp4")
    y = decode(enc)
    assert torch.isfinite(y).all()
    assert torch.equal(y[0], torch.zeros(64))
    assert int(enc.parts["scales"][0, 0]) == 0


def test_mxfp4_input_dim_must_be_multiple_of_32() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        encode(torch.randn(4, 48), "mxfp4")
    with pytest.raises(ValueError, match="multiple of 32"):
        get_codec("mxfp4").part_specs((4, 33))


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8", "mxfp4"])
def test_2d_codecs_reject_other_ranks(name: str) -> None:
    with pytest.raises(ValueError, match="2-D"):
        encode(torch.randn(64), name)
    with pytest.raises(ValueError, match="2-D"):
        encode(torch.randn(2, 64, 64), name)


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8", "mxfp4"])
def test_non_finite_input_rejected(name: str) -> None:
    x = torch.randn(4, 64)
    x[1, 2] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        encode(x, name)


def test_non_float_input_and_dtype_rejected() -> None:
    with pytest.raises(ValueError, match="floating-point"):
        encode(torch.ones(4, 32, dtype=torch.int32), "fp32")
    with pytest.raises(ValueError, match="floating point"):
        decode(encode(torch.ones(4, 32), "int8"), torch.int32)


@pytest.mark.parametrize("name", CODECS)
def test_decode_dtypes_match_fp32_decode_cast(name: str) -> None:
    x = _weights(64, 256, seed=3)
    enc = encode(x, name)
    ref = decode(enc, torch.float32)
    for dt in (torch.bfloat16, torch.float16):
        y = decode(enc, dt)
        assert y.dtype == dt and y.shape == x.shape
        assert bits_equal(y, ref.to(dt))


# ---------------------------------------------------------------------------------------------
# Bit-exact decode against the reference decoders
# ---------------------------------------------------------------------------------------------


def test_mxfp4_decode_matches_reference_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (6, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (6, 4), dtype=torch.uint8, generator=g)
    scales[0, 0], scales[0, 1], scales[1, 0], scales[1, 1] = 0, 1, 254, 255  # extremes and NaN
    enc = C.wrap_mxfp4(blocks, scales)
    assert enc.shape == (6, 128)
    ref = ref_mxfp4_decode(blocks, scales)
    assert bits_equal(decode(enc), ref)
    assert torch.isnan(decode(enc)[1, 32:64]).all()
    assert bits_equal(decode(enc, torch.bfloat16), ref.to(torch.bfloat16))
    # The encoder's own output also matches the reference.
    enc2 = encode(_weights(8, 96), "mxfp4")
    assert bits_equal(decode(enc2), ref_mxfp4_decode(enc2.parts["blocks"], enc2.parts["scales"]))


def test_fp8_decode_matches_reference_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(11)
    raw = torch.randint(0, 256, (150, 260), dtype=torch.uint8, generator=g)
    raw[(raw & 0x7F) == 0x7F] = 0x12  # no NaN codes
    weight = raw.view(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3, generator=g) * 1e-3 + 1e-5
    enc = C.wrap_fp8_block(weight, scale_inv)
    ref = ref_fp8_block_decode(weight, scale_inv)
    assert bits_equal(decode(enc), ref)
    enc2 = encode(_weights(130, 140), "fp8_e4m3")  # partial edge blocks on both dims
    assert bits_equal(decode(enc2), ref_fp8_block_decode(enc2.parts["weight"], enc2.parts["scale_inv"]))


def test_int8_decode_matches_reference() -> None:
    enc = encode(_weights(20, 40), "int8")
    q, s = enc.parts["weight"].tolist(), enc.parts["scale"].tolist()
    ref = torch.tensor([[q[i][j] * s[i] for j in range(40)] for i in range(20)], dtype=torch.float64)
    assert bits_equal(decode(enc), ref.to(torch.float32))


# ---------------------------------------------------------------------------------------------
# Wrapping already-quantized checkpoints
# ---------------------------------------------------------------------------------------------


def test_wrap_gpt_oss_expert_slices() -> None:
    g = torch.Generator().manual_seed(5)
    n_exp, out, nb = 3, 8, 2  # gpt-oss *_blocks [E, out, in/32, 16], *_scales [E, out, in/32]
    blocks = torch.randint(0, 256, (n_exp, out, nb, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (n_exp, out, nb), dtype=torch.uint8, generator=g)
    for e in range(n_exp):
        enc = C.wrap_mxfp4(blocks[e], scales[e])
        assert enc.codec == "mxfp4" and enc.shape == (out, nb * 32)
        assert torch.equal(enc.parts["blocks"], blocks[e]) and torch.equal(enc.parts["scales"], scales[e])
        assert enc.nbytes == out * nb * 17
        assert bits_equal(decode(enc), ref_mxfp4_decode(blocks[e], scales[e]))
    e8m0 = C.wrap_mxfp4(blocks[0], scales[0].view(torch.float8_e8m0fnu))
    assert e8m0.parts["scales"].dtype == torch.uint8
    with pytest.raises(ValueError):
        C.wrap_mxfp4(blocks, scales)  # 4-D: slice per expert first
    with pytest.raises(ValueError):
        C.wrap_mxfp4(blocks[0], scales[0, :, :1])


def test_wrap_fp8_block_validates() -> None:
    w = torch.zeros(300, 200).to(torch.float8_e4m3fn)
    enc = C.wrap_fp8_block(w, torch.ones(3, 2))
    assert enc.shape == (300, 200)
    with pytest.raises(ValueError, match="scale_inv"):
        C.wrap_fp8_block(w, torch.ones(2, 2))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        C.wrap_fp8_block(w.float(), torch.ones(3, 2))


def test_validate_rejects_wrong_parts() -> None:
    enc = encode(torch.randn(4, 32), "int8")
    bad = EncodedTensor("int8", enc.shape, {"weight": enc.parts["weight"]})
    with pytest.raises(ValueError, match="parts"):
        get_codec("int8").validate(bad)
    bad2 = EncodedTensor("int8", enc.shape, {"weight": enc.parts["weight"], "scale": torch.ones(4).double()})
    with pytest.raises(ValueError, match="scale"):
        get_codec("int8").validate(bad2)
