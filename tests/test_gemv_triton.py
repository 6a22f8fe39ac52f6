"""The Triton GEMVs over compact weights (engine/kernels/gemv_triton.py) against the decode paths, on CPU
through Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is imported, so the
check runs in a fresh interpreter). Their launch on a GPU is covered by `-m cuda` tests
(tests/test_mxfp4.py, and the engines' self-checks)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

_CHECK = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from freetoken_agents.engine.ftw.codecs import get_codec
    from freetoken_agents.engine.kernels.gemv_triton import (
        int8_gemv, int8_grouped_gemv, mxfp4_gemv, mxfp4_grouped_gemv,
    )
    from freetoken_agents.engine.kernels.int8 import dequant_linear, quantize
    from freetoken_agents.engine.kernels.mxfp4 import decode_weight

    def rel(got, want):
        return float(((got - want).abs() / want.abs().amax(dim=1, keepdim=True)).max())

    g = torch.Generator().manual_seed(0)
    # Rows not a multiple of a program's 32, inputs not a multiple of a step's 128, 1-8 tokens,
    # every E2M1 code, scales from 2**-20 to 2**20, bf16 activations.
    for n, k, t in [(48, 160, 3), (7, 64, 1), (33, 288, 8), (64, 128, 2)]:
        w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-20, 20, (n, 1), generator=g).float())
        enc = get_codec("mxfp4").encode(w)
        blocks, scales = enc.parts["blocks"].reshape(n, k // 2), enc.parts["scales"]
        codes = torch.cat([(blocks & 15).flatten(), (blocks >> 4).flatten()])
        assert n < 33 or set(codes.tolist()) == set(range(16))
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(t, k, generator=g).to(dtype)
            want = F.linear(x.float(), decode_weight(blocks, scales, torch.float32))
            assert rel(mxfp4_gemv(x, blocks, scales), want) < 1e-5, ("mxfp4", n, k, t, dtype)
            q, scale = quantize(w)
            want = dequant_linear(x.float(), q, scale)
            assert rel(int8_gemv(x, q, scale), want) < 1e-5, ("int8", n, k, t, dtype)

    # Grouped: 3 experts stacked in one byte buffer per slot (slots at a padded stride, as tier 1's
    # pool lays them out); 2 tokens x 2 routes (gate_up: a token's row shared by its routes,
    # x_div=2) and 4 routes of their own rows (down, x_div=1). Each route equals the plain GEMV
    # of its slot's weight, bit for bit.
    n, k, stride = 40, 160, 12288
    ws = [torch.randn(n, k, generator=g) for _ in range(3)]
    buf = torch.zeros(3, stride, dtype=torch.uint8)
    qs = [quantize(w) for w in ws]
    encs = [get_codec("mxfp4").encode(w) for w in ws]
    def put(offset, parts):  # each slot's tensor at `offset` of its row -> the [3, ...] strided view
        first = parts[0]
        size = first.numel() * first.element_size()
        for s, part in enumerate(parts):
            buf[s, offset : offset + size].view(first.dtype).view(first.shape).copy_(part)
        typed = buf.view(first.dtype)
        es = first.element_size()
        inner = [1]
        for d in reversed(first.shape[1:]):
            inner.insert(0, inner[0] * d)
        return typed.as_strided((3, *first.shape), (stride // es, *inner), offset // es)
    q_st = put(0, [q for q, _ in qs])
    s_st = put(6400, [s for _, s in qs])
    b_st = put(6656, [e.parts["blocks"].reshape(n, k // 2) for e in encs])
    e_st = put(9984, [e.parts["scales"] for e in encs])
    slots = torch.tensor([2, 0, 1, 2])
    for x, x_div in ((torch.randn(2, k, generator=g), 2), (torch.randn(4, k, generator=g), 1)):
        got_q = int8_grouped_gemv(x, q_st, s_st, slots, x_div)
        got_m = mxfp4_grouped_gemv(x, b_st, e_st, slots, x_div)
        for r, slot in enumerate(slots.tolist()):
            row = x[r // x_div : r // x_div + 1]
            assert torch.equal(got_q[r : r + 1], int8_gemv(row, *qs[slot])), ("int8 grouped", r)
            blocks = encs[slot].parts["blocks"].reshape(n, k // 2)
            assert torch.equal(got_m[r : r + 1], mxfp4_gemv(row, blocks, encs[slot].parts["scales"]))
    print("ok")
    """
)


def test_gemv_kernels_equal_the_decode_paths_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.cuda
def test_the_kernels_pass_their_self_checks_and_serve_decode_on_the_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from freetoken_agents.engine.kernels.int8 import dequant_linear, gpu_kernel_ok, int8_linear, quantize
    from freetoken_agents.engine.kernels.mxfp4 import kernel_ok

    device = torch.device("cuda", torch.cuda.current_device())
    assert gpu_kernel_ok(device) and kernel_ok(device)
    q, scale = quantize(torch.randn(1536, 2048))
    q, scale = q.to(device), scale.to(device)
    x = torch.randn(1, 2048, device=device, dtype=torch.bfloat16)
    want = dequant_linear(x.float(), q, scale)
    tol = 2e-2 * float(want.abs().max())  # bf16 activations and output
    torch.testing.assert_close(int8_linear(x, q, scale).float(), want, rtol=2e-2, atol=tol)


def test_weights_with_strided_rows_are_refused_with_a_named_error():
    """The kernels step along a row one element at a time: a weight or scale whose rows are not
    contiguous is a ValueError before any launch (no wrong values read through strides)."""
    import torch

    from freetoken_agents.engine.kernels.gemv_triton import int8_grouped_gemv, mxfp4_grouped_gemv

    x, slots = torch.randn(1, 8), torch.zeros(1, dtype=torch.long)
    q = torch.zeros(2, 4, 16, dtype=torch.int8)[:, :, ::2]  # every other input: stride 2
    with pytest.raises(ValueError, match="contiguous along their last dimension"):
        int8_grouped_gemv(x, q, torch.ones(2, 4), slots)
    blocks = torch.zeros(2, 4, 4, dtype=torch.uint8)
    scales = torch.zeros(2, 4, 2, dtype=torch.uint8)[:, :, ::2]
    with pytest.raises(ValueError, match="contiguous along their last dimension"):
        mxfp4_grouped_gemv(x, blocks, scales, slots)
