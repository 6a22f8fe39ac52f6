"""The Triton GEMVs over compact weights (engine/gemv_triton.py) against the decode paths, on CPU
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
    from freetoken_agents.engine.codecs import get_codec
    from freetoken_agents.engine.gemv_triton import int8_gemv, mxfp4_gemv
    from freetoken_agents.engine.int8 import dequant_linear, quantize
    from freetoken_agents.engine.mxfp4 import decode_weight

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
    from freetoken_agents.engine.int8 import dequant_linear, gpu_kernel_ok, int8_linear, quantize
    from freetoken_agents.engine.mxfp4 import kernel_ok

    device = torch.device("cuda", torch.cuda.current_device())
    assert gpu_kernel_ok(device) and kernel_ok(device)
    q, scale = quantize(torch.randn(1536, 2048))
    q, scale = q.to(device), scale.to(device)
    x = torch.randn(1, 2048, device=device, dtype=torch.bfloat16)
    want = dequant_linear(x.float(), q, scale)
    tol = 2e-2 * float(want.abs().max())  # bf16 activations and output
    torch.testing.assert_close(int8_linear(x, q, scale).float(), want, rtol=2e-2, atol=tol)
