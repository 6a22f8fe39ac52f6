"""The exactness checks of bench/cpu_codec_kernels.py on one tiny shape (no timings), so that the
bench's candidates keep computing what its tables claim.

Every candidate is read back with unit activations (x = I gives each weight it computes with, times
1.0, plus zeros: exact in fp32 and bf16) and run on random activations against the float64 product
of the codec's decoded weights:

- a candidate that claims exactness holds the codec's decoded weights bit for bit, and its output
  stays inside the float32 forward-error bound of a K-long dot product in any summation order,
  gamma_(K+2) * |x| @ |W|.T (K products and sums plus a scale applied after the sum), elementwise;
- any other candidate stays within the error it states, relative to the largest output: `BF16_REL`
  (2**-5) for bf16 activations, bf16 scales or a per-row re-quantization (bf16 carries 8
  significant bits, so their errors sit near 2**-8, while a wrong layout or formula gives errors of
  order 1); 2**-18 for int4pack's fp32 scales on the codec's own fp32 scales, where (q - 8) * scale
  rounds once more per weight than the codec's decode.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "bench" / "cpu_codec_kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("cpu_codec_kernels", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows(bench):
    # K = 256: the smallest input width a Q4_K super-block allows; N = 32: int4pack needs N % 16 == 0
    with torch.inference_mode():
        return bench.exactness_rows(n=32, k=256, tokens=4, seed=3)


def _row(rows, source, candidate):
    (hit,) = [r for r in rows if r["source"] == source and r["candidate"] == candidate]
    return hit


def test_exact_candidates_hold_the_codec_values_and_the_fp32_bound(rows):
    exact = [r for r in rows if r["claims_exact"]]
    assert len(exact) >= 12
    for r in exact:
        where = f"{r['codec']} {r['source']} {r['candidate']}"
        assert r["held_bit_exact"] and r["probe_bit_exact"], where
        assert r["within_fp32_bound"], where


def test_approximate_candidates_stay_within_their_stated_error(bench, rows):
    approx = [r for r in rows if not r["claims_exact"]]
    assert approx
    for r in approx:
        assert 0 < r["approx_rel"] <= bench.BF16_REL
        assert r["out_max_rel"] <= r["approx_rel"], f"{r['codec']} {r['source']} {r['candidate']}"


def test_every_codec_has_an_exact_block_decode(rows):
    for codec, sources in (("int8_b32", ("Q8_0", "own")), ("uint4_b32", ("Q4_0", "Q4_1", "Q4_K", "own"))):
        for source in sources:
            assert _row(rows, source, f"block_{codec}")["claims_exact"]
    assert {r["codec"] for r in rows if r["candidate"].startswith("block_")} == {
        "int8_b32",
        "uint4_b32",
        "int8",
        "mxfp4",
    }


def test_int4pack_maps_gguf_q4_exactly_only_with_fp32_scales(rows):
    # (q - 8) * scale + (min + 8 * scale) is the codec's q * scale + min, rounded once, when the
    # product is exact in fp32: GGUF scales are an fp16 (Q4_0/Q4_1) or an fp16 times a 6-bit int
    for source in ("Q4_0", "Q4_1", "Q4_K"):
        assert _row(rows, source, "int4pack_fp32")["held_bit_exact"], source
        bf16 = _row(rows, source, "int4pack_bf16")
        assert not bf16["held_bit_exact"], source  # bf16 scales drop the fp16 scale's low bits
        assert bf16["probe_vs_held_bf16"], source  # the kernel computes fma(q, s, fma(s, -8, z))


def test_q8_0_per_block_int8pack_keeps_the_weights_and_requantizing_does_not(rows):
    assert _row(rows, "Q8_0", "q8_blocks_fp32")["held_bit_exact"]
    assert _row(rows, "Q8_0", "q8_blocks_bf16")["probe_bit_exact"]  # bf16 activations, exact weights
    requant = _row(rows, "Q8_0", "q8_requant")
    assert not requant["held_bit_exact"]
    assert 0 < requant["held_max_rel"] < 2.0**-6
