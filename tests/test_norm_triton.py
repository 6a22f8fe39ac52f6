"""The fused RMSNorm kernel (engine/kernels/norm_triton.py) against `layers.RMSNorm`'s PyTorch ops, on CPU
through Triton's interpreter (TRITON_INTERPRET=1 must precede triton's import: a fresh
interpreter). On a GPU (-m cuda) RMSNorm serves through it after its self-check."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

_CHECK = textwrap.dedent(
    """
    import torch
    from freetoken_agents.engine.model.layers import RMSNorm
    from freetoken_agents.engine.kernels.norm_triton import add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(0)
    # Hidden sizes that are and are not powers of two (gpt-oss 2880), one and several rows,
    # rows with a large range, bf16 and fp32, a weight in the activation dtype or in fp32.
    for h, rows in ((64, 1), (2880, 3), (4096, 2), (7168, 1)):
        for dtype in (torch.bfloat16, torch.float32):
            for in_fp32 in (False, True):
                norm = RMSNorm(h, 1e-6, weight_in_fp32=in_fp32)
                norm.weight.data = torch.rand(h, generator=g) + 0.5
                if not in_fp32:
                    norm.weight.data = norm.weight.data.to(dtype)
                scale = torch.exp2(torch.randint(-8, 8, (rows, 1), generator=g).float())
                x = (torch.randn(rows, h, generator=g) * scale).to(dtype)
                want = norm.forward(x)
                got = rms_norm(x, norm.weight, norm.eps, in_fp32)
                assert got.dtype == want.dtype == dtype and got.shape == want.shape
                # The sum of squares is added in another order: the scale differs by a few fp32
                # ulps, so h and the product in bf16 may each round the other way (<= 2**-7 each).
                tol = 2**-6 if dtype == torch.bfloat16 else 1e-6
                err = float(((got.float() - want.float()).abs() / want.float().abs().clamp(min=1e-30)).max())
                assert err <= tol, (h, rows, dtype, in_fp32, err)
                if dtype == torch.bfloat16:  # the scale's few fp32 ulps rarely move a bf16 rounding
                    same = float((got == want).float().mean())
                    assert same > 0.97, (h, in_fp32, same)
    # The residual add fused in front: the sum exactly as PyTorch adds (rounded to the dtype),
    # the norm of it as above.
    for dtype in (torch.bfloat16, torch.float32):
        norm = RMSNorm(2880, 1e-5)
        norm.weight.data = (torch.rand(2880, generator=g) + 0.5).to(dtype)
        x = torch.randn(2, 2880, generator=g).to(dtype)
        r = (torch.randn(2, 2880, generator=g) * 3).to(dtype)
        want_s, want_h = norm.add_forward(x, r)  # the PyTorch ops on CPU
        got_s, got_h = add_rms_norm(x, r, norm.weight, norm.eps, False)
        assert torch.equal(got_s, want_s), dtype
        tol = 2**-6 if dtype == torch.bfloat16 else 1e-6
        err = (got_h.float() - want_h.float()).abs() / want_h.float().abs().clamp(min=1e-30)
        assert float(err.max()) <= tol, (dtype, float(err.max()))
    x3 = torch.randn(2, 3, 64, generator=g)  # any leading shape
    norm = RMSNorm(64, 1e-5)
    assert torch.allclose(rms_norm(x3, norm.weight, 1e-5, False), norm.forward(x3), rtol=1e-6, atol=1e-6)
    print("ok")
    """
)


def test_the_fused_rms_norm_equals_the_pytorch_ops_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.cuda
def test_rms_norm_runs_the_fused_kernel_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from freetoken_agents.engine.kernels import norm_triton
    from freetoken_agents.engine.model.layers import RMSNorm

    device = torch.device("cuda", torch.cuda.current_device())
    assert norm_triton.kernel_ok(device)
    norm = RMSNorm(2048, 1e-6).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(1, 2048, device=device, dtype=torch.bfloat16)
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm.forward(x), norm.weight * h.to(x.dtype), rtol=2**-7, atol=2**-7)
