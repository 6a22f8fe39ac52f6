"""The FTW codecs that hold GGUF experts exactly (int8_b32, uint4_b32) and the GGUF block conversions.

Reference: `gguf.quants.dequantize` (gguf-py, llama.cpp's reference decoder), bit for bit (Q4_0
values equal, only the sign of zero may differ: ``d * (q - 8)`` vs ``d * q - 8 d``).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_models import _raw_k_blocks

from freetoken_agents.engine.ftw import FTWFile, FTWWriter
from freetoken_agents.engine.ftw.codecs import decode, encode, get_codec
from freetoken_agents.engine.loading.gguf.quants import encoded_weight
from freetoken_agents.engine.loading.gguf.reader import GGUFTensor


def _bits(a: torch.Tensor | np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.int32)


def _stacked(qtype: Q, shape=(3, 16, 512), seed=0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * 0.1
    if qtype in (Q.Q4_K, Q.Q6_K):
        data = _raw_k_blocks(shape, qtype, rng)
    elif qtype == Q.F16:
        data = x.astype(np.float16)
    else:
        data = gguf.quants.quantize(x, qtype)
    return data, gguf.quants.dequantize(data, qtype).reshape(shape)


@pytest.mark.parametrize(
    ("qtype", "codec"),
    [
        (Q.Q8_0, "int8_b32"),
        (Q.Q4_0, "uint4_b32"),
        (Q.Q4_1, "uint4_b32"),
        (Q.Q4_K, "uint4_b32"),
        (Q.MXFP4, "mxfp4"),
        (Q.BF16, "bf16"),
        (Q.F16, "fp32"),
        (Q.Q6_K, "fp32"),
        (Q.Q5_0, "fp32"),
    ],
)
def test_gguf_expert_slices_decode_to_gguf_py_values(qtype, codec):
    data, ref = _stacked(qtype)
    t = GGUFTensor("blk.0.ffn_gate_exps.weight", qtype, ref.shape, data, Path("x.gguf"))
    for e in range(ref.shape[0]):
        enc = encoded_weight(t, Path("x.gguf"), e)
        assert enc.codec == codec and enc.shape == ref.shape[1:]
        got = decode(enc).numpy()
        assert np.array_equal(got, ref[e])
        if qtype != Q.Q4_0:
            assert np.array_equal(_bits(got), _bits(ref[e]))


def test_mxfp4_scale_255_falls_back_to_fp32():
    data, ref = _stacked(Q.MXFP4, (1, 2, 64))
    data = data.copy()
    data[0, 0, 0] = 255  # ggml: a finite 2**128 scale; OCP E8M0: NaN
    ref = gguf.quants.dequantize(data, Q.MXFP4).reshape(ref.shape)
    enc = encoded_weight(GGUFTensor("t", Q.MXFP4, ref.shape, data, Path("x")), Path("x"), 0)
    assert enc.codec == "fp32" and np.array_equal(_bits(decode(enc)), _bits(ref[0]))


@pytest.mark.parametrize("name", ["int8_b32", "uint4_b32"])
def test_encode_from_float_is_close_and_decodes_to_every_dtype(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 256, generator=g) * 0.05
    x[3, :32] = 0.0  # an all-zero block
    enc = encode(x, name)
    get_codec(name).validate(enc)
    y = decode(enc)
    step = 0.05 * 4 / (127 if name == "int8_b32" else 15)
    assert (y - x).abs().max() < step and bool((y[3, :32] == 0).all())
    for dt in (torch.bfloat16, torch.float16):
        assert torch.equal(decode(enc, dt), y.to(dt))
    with pytest.raises(ValueError, match="multiple of 32"):
        encode(torch.randn(4, 40), name)


def test_new_codecs_round_trip_through_an_ftw_file_bit_for_bit(tmp_path):
    blocks = {}
    for qtype, name in ((Q.Q8_0, "gate_up"), (Q.Q4_K, "down")):
        data, _ = _stacked(qtype, (1, 64, 256), seed=1)
        blocks[name] = encoded_weight(GGUFTensor("t", qtype, (1, 64, 256), data, Path("x")), Path("x"), 0)
    blocks["up"] = encode(torch.randn(64, 256), "uint4_b32")
    path = tmp_path / "c.ftw"
    with FTWWriter(path, model_config={"model_type": "x"}) as w:
        w.add_expert(0, 0, blocks, compress=False)
        w.add_expert(0, 1, blocks, compress=True)
    with FTWFile(path) as f:
        for e in (0, 1):
            got = f.encoded_expert(0, e)
            for name, enc in blocks.items():
                assert got[name].codec == enc.codec and got[name].shape == enc.shape
                for part, t in enc.parts.items():
                    assert torch.equal(got[name].parts[part], t), (name, part)
                assert torch.equal(_bits_t(decode(got[name])), _bits_t(decode(enc)))


def _bits_t(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)
