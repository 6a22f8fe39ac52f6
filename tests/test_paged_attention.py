"""Decode attention reads the paged KV cache in place (engine/kernels/paged_attention.py)."""

from __future__ import annotations

import pytest
import torch

from freetoken_agents.engine import Engine
from freetoken_agents.engine.kernels import paged_attention
from freetoken_agents.engine.kernels.paged_attention import (
    chunk_views,
    decode_gqa,
    decode_mla,
    heads_first_views,
    position_chunks,
    slot_runs,
)
from freetoken_agents.engine.model.kv import BlockPool, BlockTable, StreamSpec

pytestmark = pytest.mark.usefixtures("one_thread")


def test_slot_runs_follow_consecutive_blocks():
    blocks = [3, 4, 5, 9, 10, 2]  # block size 4: positions 0-11 in 3-5, 12-19 in 9-10, 20- in 2
    assert slot_runs(blocks, 4, 0, 22) == [(12, 12), (36, 8), (8, 2)]
    assert slot_runs(blocks, 4, 5, 22) == [(17, 7), (36, 8), (8, 2)]
    assert slot_runs(blocks, 4, 13, 15) == [(37, 2)]
    assert slot_runs(blocks, 4, 7, 7) == []


def test_position_chunks_cut_at_fixed_positions_whatever_the_blocks():
    contiguous = position_chunks([0, 1, 2, 3, 4, 5], 4, 3, 22, chunk=8)
    scattered = position_chunks([7, 1, 5, 3, 2, 9], 4, 3, 22, chunk=8)
    assert [c[:2] for c in contiguous] == [c[:2] for c in scattered] == [(3, 8), (8, 16), (16, 22)]
    assert [c[2] for c in contiguous] == [3, 8, 16]  # one run each: read in place
    assert [c[2] for c in scattered] == [None, None, None]  # each straddles a break: gathered
    assert position_chunks([7, 8, 5, 6], 4, 0, 16, chunk=8) == [(0, 8, 28), (8, 16, 20)]


def _reference(q, k, v, scaling, sinks=None):
    """Plain softmax attention of one token: q [N, D], k/v [S, K, D] (repeats kv heads)."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [S, N, D]
    scores = torch.einsum("nd,snd->ns", q, k) * scaling
    if sinks is not None:
        scores = torch.cat([scores, sinks[:, None]], dim=-1)
    probs = torch.softmax(scores, dim=-1)[:, : k.shape[0]]
    return torch.einsum("ns,snd->nd", probs, v)


def _pool_with(seq: torch.Tensor, blocks: list[int], block_size: int) -> torch.Tensor:
    """Slot-addressed storage holding `seq [S, ...]` at the positions' slots in `blocks`."""
    flat = torch.full((max(blocks) * block_size + block_size, *seq.shape[1:]), float("nan"))
    for p in range(seq.shape[0]):
        flat[blocks[p // block_size] * block_size + p % block_size] = seq[p]
    return flat


LAYOUTS = [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 3, 4, 5, 0, 1, 7, 8, 2, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]]


@pytest.mark.parametrize("flash", [True, False], ids=["cpu-flash", "matmul"])
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_gqa_matches_plain_attention_and_ignores_the_layout(flash, sinks, monkeypatch):
    if not flash:  # the path CUDA and other devices take
        monkeypatch.setattr(paged_attention, "_flash_cpu", None)
    g = torch.Generator().manual_seed(0)
    n, kv, d, s, bs = 8, 2, 16, 37, 4
    q = torch.randn(n, d, generator=g)
    k, v = torch.randn(s, kv, d, generator=g), torch.randn(s, kv, d, generator=g)
    sink = torch.randn(n, generator=g) if sinks else None
    want = _reference(q, k, v, 0.25, sink)
    results = []
    for blocks in LAYOUTS:
        kf, vf = _pool_with(k, blocks, bs), _pool_with(v, blocks, bs)
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(s)])
        for start in (0, 11):  # the whole cache, and a sliding window of its last 26 positions
            chunks = position_chunks(blocks, bs, start, s, chunk=8)
            keys, values = heads_first_views(kf, chunks, slots), heads_first_views(vf, chunks, slots)
            got = decode_gqa(q, keys, values, 0.25, sink).view(n, d)
            ref = want if start == 0 else _reference(q, k[start:], v[start:], 0.25, sink)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            results.append(got)
    for other in range(2, len(results), 2):  # bit for bit the same whatever the blocks
        assert torch.equal(results[other], results[0]) and torch.equal(results[other + 1], results[1])


def test_decode_mla_matches_plain_latent_attention_and_ignores_the_layout():
    g = torch.Generator().manual_seed(1)
    n, r, p, s, bs = 4, 12, 6, 29, 4
    q_lat, q_rope = torch.randn(n, r, generator=g), torch.randn(n, p, generator=g)
    lat, kr = torch.randn(s, r, generator=g), torch.randn(s, p, generator=g)
    probs = torch.softmax((q_lat @ lat.T + q_rope @ kr.T) * 0.3, dim=-1)
    want = probs @ lat
    results = []
    for blocks in LAYOUTS:
        slots = torch.tensor([blocks[i // bs] * bs + i % bs for i in range(s)])
        chunks = position_chunks(blocks, bs, 0, s, chunk=8)
        lats = chunk_views(_pool_with(lat, blocks, bs), chunks, slots)
        krs = chunk_views(_pool_with(kr, blocks, bs), chunks, slots)
        results.append(decode_mla(q_lat, q_rope, lats, krs, 0.3))
        torch.testing.assert_close(results[-1], want, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(x, results[0]) for x in results)


def test_a_table_asks_for_the_block_after_its_last_one():
    pool = BlockPool([[StreamSpec("k", (2,))]], block_size=2)
    a, b, c = BlockTable(pool), BlockTable(pool), BlockTable(pool)
    c.reserve(2)  # block 0
    a.reserve(2)  # block 1
    c.release()  # block 0 is the lowest free one again
    a.reserve(2)  # block 2 follows a's block 1 (the lowest free id, 0, would break a's run)
    b.reserve(2)
    a.reserve(2)
    assert a.blocks == [1, 2, 3] and b.blocks == [0]
    assert slot_runs(a.blocks, 2, 0, a.length) == [(2, 6)]
    assert pool.allocate(prefer=2) == 4  # a block in use is never handed out


def test_engine_decode_reads_the_cache_in_place_and_ignores_block_layout(tiny_checkpoint, monkeypatch):
    """A session whose blocks are scattered (other sessions took the ones after its own) decodes
    to bit-identical logits, and decode never gathers the whole cache (`BlockTable.read`)."""
    engine = Engine.from_pretrained(tiny_checkpoint("gpt_oss"))  # sliding window, sinks, GQA
    ids = torch.randint(0, engine.spec.vocab_size, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    with engine.new_session() as s:
        s.prefill(ids[:20])
        want = torch.stack([s.decode(t) for t in ids[20:]])
    others = [engine.new_session() for _ in range(3)]
    reads: list[int] = []
    real_read = BlockTable.read
    monkeypatch.setattr(BlockTable, "read", lambda self, *a: reads.append(self.length) or real_read(self, *a))
    with engine.new_session() as s:
        s.prefill(ids[:20])
        prefill_reads = len(reads)
        got = []
        for t in ids[20:]:
            for o in others:  # take the free blocks as they come
                o.prefill([1])
            got.append(s.decode(t))
        assert len(slot_runs(s.table.blocks, engine.kv_pool.block_size, 0, s.table.length)) > 1
    for o in others:
        o.close()
    assert prefill_reads > 0 and len(reads) == prefill_reads  # decode gathered nothing
    assert torch.equal(torch.stack(got), want)
