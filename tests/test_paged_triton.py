"""The Triton paged-decode kernel (engine/kernels/paged_triton.py) against the eager paged attention, on
CPU through Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is imported, so
each check runs in a fresh interpreter). The GPU launch itself is tested by -m cuda tests."""

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
    from freetoken_agents.engine.kernels.paged_attention import (
        chunk_views, decode_gqa, decode_mla, heads_first_views, position_chunks)
    from freetoken_agents.engine.kernels.paged_triton import paged_decode

    g = torch.Generator().manual_seed(0)
    bs, blocks = 4, [9, 3, 4, 5, 0, 1, 7, 8, 2, 6]  # scattered: several runs
    s = 37
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(s)])
    table = torch.tensor(blocks + [0] * 6, dtype=torch.int32)  # padded, as the graph holds it

    def pool(seq):
        flat = torch.zeros(40, *seq.shape[1:])
        flat[slots] = seq
        return flat

    # GQA: 8 query heads on 2 kv heads, with and without sinks, whole cache and a window.
    n, kv, d = 8, 2, 16
    q = torch.randn(n, d, generator=g)
    k, v = pool(torch.randn(s, kv, d, generator=g)), pool(torch.randn(s, kv, d, generator=g))
    for sinks in (None, torch.randn(n, generator=g)):
        for start in (0, 11):
            for splits in (1, 3, 8):
                chunks = position_chunks(blocks, bs, start, s, chunk=8)
                want = decode_gqa(q, heads_first_views(k, chunks, slots), heads_first_views(v, chunks, slots),
                                  0.25, sinks).view(kv, n // kv, d)
                meta = torch.tensor([start, s], dtype=torch.int32)
                got = paged_decode(q.view(kv, n // kv, d), k, v, table, meta, 0.25, bs, sinks=sinks,
                                   splits=splits, block_n=16)
                err = (got - want).abs().max().item()
                assert err < 1e-5, ("gqa", sinks is not None, start, splits, err)

    # MLA: one kv head whose key is (latent, rotary key) and whose value is the latent.
    heads, r, p = 4, 12, 6
    q_lat, q_rope = torch.randn(heads, r, generator=g), torch.randn(heads, p, generator=g)
    lat, kr = pool(torch.randn(s, r, generator=g)), pool(torch.randn(s, p, generator=g))
    chunks = position_chunks(blocks, bs, 0, s, chunk=8)
    want = decode_mla(q_lat, q_rope, chunk_views(lat, chunks, slots), chunk_views(kr, chunks, slots), 0.3)
    meta = torch.tensor([0, s], dtype=torch.int32)
    got = paged_decode(q_lat[None], lat[:, None], lat[:, None], table, meta, 0.3, bs,
                       q2=q_rope[None], k2=kr[:, None], splits=4, block_n=16)[0]
    err = (got - want).abs().max().item()
    assert err < 1e-5, ("mla", err)
    print("OK")
    """
)


def test_triton_paged_decode_matches_eager_paged_attention_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]
