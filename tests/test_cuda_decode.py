"""The static (CUDA-graph) decode step (engine/runtime/cuda_graph.py) against the eager one.

On CPU: the static step uncaptured, its attention through the Triton kernel in Triton's
interpreter (a fresh interpreter per check: TRITON_INTERPRET=1 must precede triton's import),
for GQA, GQA with sinks and a sliding window, and MLA. On a GPU (-m cuda): the captured graph,
replays, recapture, the eager fallback, and the device pieces (kernel, slots, grouped GEMM).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tiny_models import ARCHS

from freetoken_agents.engine import Engine

_STATIC_VS_EAGER = textwrap.dedent(
    """
    import sys, torch
    from freetoken_agents.engine import Engine
    from freetoken_agents.engine.runtime.cuda_graph import DecodeGraphs, StaticDecode

    path = sys.argv[1]
    eager, static = Engine.from_pretrained(path), Engine.from_pretrained(path)
    runner = static.decode_runner
    runner.use_graphs(DecodeGraphs(static.model, StaticDecode))  # what a CUDA device would capture
    ids = torch.randint(0, eager.spec.vocab_size, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    with eager.new_session() as a, static.new_session() as b:
        a.prefill(ids[:20])
        b.prefill(ids[:20])
        want = torch.stack([a.decode(t) for t in ids[20:]])
        got = torch.stack([b.decode(t) for t in ids[20:]])
    err = float((got - want).abs().max() / want.abs().max())
    assert runner.graphs.replays == 10 and runner.graphs.captures == 1, vars(runner.graphs)
    assert err < 1e-4, err
    print("OK", err)
    """
)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_static_decode_step_equals_eager_decode_on_cpu(arch, tiny_checkpoint):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", _STATIC_VS_EAGER, str(tiny_checkpoint(arch))]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


# ---- on a GPU -------------------------------------------------------------------------------------
# bf16 rounds at different points in the kernel and in SDPA/matmul: the reference tests' bound.
BF16_TOL = 5e-2


def _decode_both(eager: Engine, graphs: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits [40, V] of the same 40 decode steps after a 20-token prompt: (eager, graphs)."""
    ids = torch.randint(0, graphs.spec.vocab_size, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    with eager.new_session() as a, graphs.new_session() as b:
        a.prefill(ids[:20])
        want = torch.stack([a.decode(t) for t in ids[20:]]).float()
        b.prefill(ids[:20])
        got = torch.stack([b.decode(t) for t in ids[20:]]).float()
    return want, got


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_equals_eager_decode(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    graphs = Engine.from_pretrained(path, device="cuda", dtype=torch.bfloat16)
    eager = Engine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, cuda_graphs=False)
    want, got = _decode_both(eager, graphs)
    assert eager.decode_runner.graphs is None
    g = graphs.decode_runner.graphs
    assert g is not None, "the resident bf16 engine should decode by CUDA graph"
    assert g.replays == 40 and g.captures == 1
    err = float((got - want).abs().max() / want.abs().max())
    print(f"{arch}: CUDA graph vs eager decode, bf16, max|diff|/max|logit| = {err:.2e}")
    assert err < BF16_TOL


@pytest.mark.parametrize("room", [None, 2])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_tiered_decode_step_is_a_cuda_graph_over_the_slot_pool(room, tiny_checkpoint, tmp_path):
    """Tier 1 as slots on the GPU: the tiered decode step is captured; with every expert fitting
    it replays, and with room for two layers' working sets a replay that misses tier 1 is
    recomputed eagerly. Either way the tokens of the eager tiered engine."""
    from freetoken_agents.engine.memory import MemoryBudget

    path = tiny_checkpoint("mixtral")
    probe = Engine.from_pretrained(path, device="cuda", dtype=torch.bfloat16, memory=MemoryBudget(),
                                   placement="qstar", cache_dir=tmp_path)  # fmt: skip
    fast = None if room is None else room * probe.experts.min_working_set + 8 * probe.kv_pool.bytes_per_block
    probe.experts.close()

    def tiered(graphs: bool) -> Engine:
        return Engine.from_pretrained(
            path, device="cuda", dtype=torch.bfloat16, memory=MemoryBudget(fast_bytes=fast),
            placement="qstar", cache_dir=tmp_path, cuda_graphs=graphs,
        )  # fmt: skip

    graphs, eager = tiered(True), tiered(False)
    assert graphs.experts.graph_safe
    want, got = _decode_both(eager, graphs)
    g = graphs.decode_runner.graphs
    assert g is not None and g.captures >= 1 and g.replays > 0
    print(f"tiered room={room}: graph {vars(g)}, store {graphs.experts.stats()['graph_steps']}")
    if room is None:
        assert g.replays - g.reruns >= 30  # warm: every routed expert in tier 1
    err = float((got - want).abs().max() / want.abs().max())
    assert err < BF16_TOL
    for e in (graphs, eager):
        e.experts.close()


@pytest.mark.parametrize(("codec", "arch"), [("int8", "mixtral"), ("mxfp4", "gpt_oss")])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compact_experts_decode_as_a_cuda_graph_resident_and_tiered(codec, arch, tiny_checkpoint, tmp_path):
    """int8 / MXFP4 experts kept compact (`expert_quant="compact"`): the resident stacks and the
    tiered slot pool run them as grouped GEMVs, so both decode steps are captured; the tokens of
    the eager engines."""
    from freetoken_agents.engine.loading.convert import convert_checkpoint
    from freetoken_agents.engine.memory import MemoryBudget

    ftw = tmp_path / f"{arch}-{codec}.ftw"
    convert_checkpoint(tiny_checkpoint(arch), ftw, quant=codec, progress=False)
    for memory in (None, MemoryBudget()):
        kwargs = dict(device="cuda", dtype=torch.bfloat16, expert_quant="compact", cache_dir=tmp_path)
        if memory is not None:
            kwargs.update(memory=memory, placement="qstar")
        graphs = Engine.from_pretrained(ftw, **kwargs)
        eager = Engine.from_pretrained(ftw, cuda_graphs=False, **kwargs)
        assert graphs.experts.graph_safe, type(graphs.experts).__name__
        want, got = _decode_both(eager, graphs)
        g = graphs.decode_runner.graphs
        assert g is not None and g.captures >= 1 and g.replays - g.reruns >= 30, vars(g)
        err = float((got - want).abs().max() / want.abs().max())
        assert err < BF16_TOL, (memory, err)
        for e in (graphs, eager):
            e.experts.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_is_recaptured_when_the_table_outgrows_it(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint("mixtral"), device="cuda", dtype=torch.bfloat16)
    limit = engine.max_context
    with engine.new_session() as s:
        s.prefill([1] * 16)
        for t in range(min(limit - 20, 64 * engine.kv_pool.block_size + 40)):
            s.decode(t % engine.spec.vocab_size)
            if s.position >= limit - 1:
                break
    g = engine.decode_runner.graphs
    assert g is not None and g.captures >= 1 and g.replays > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_runner_switches_between_graph_and_eager_mid_session(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint("mixtral"), device="cuda", dtype=torch.bfloat16)
    runner = engine.decode_runner
    with engine.new_session() as s:
        s.prefill(list(range(1, 17)))
        s.decode(20)
        first = runner.graphs
        assert first is not None and first.replays == 1
        runner.cuda_graphs = False
        s.decode(21)
        assert runner.graphs is None
        runner.cuda_graphs = True
        s.decode(22)
        assert runner.graphs is not None and runner.graphs is not first and runner.graphs.captures == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_pieces_run():
    """The Triton kernel, the slot pool and the grouped GEMM on the device, vs the eager code."""
    from freetoken_agents.engine.kernels.paged_attention import decode_gqa, heads_first_views, position_chunks
    from freetoken_agents.engine.kernels.paged_triton import paged_decode
    from freetoken_agents.engine.memory.slots import ExpertSlots
    from freetoken_agents.engine.model.experts import ExpertWeights, dispatch_experts, expert_forward
    from freetoken_agents.engine.model.grouped_experts import grouped_mm_available
    from freetoken_agents.engine.spec import MoESpec

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    blocks, bs, s, n, kv, d = [5, 6, 1, 2, 3, 0, 4], 16, 100, 32, 4, 128
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(s)])
    k = torch.zeros(8 * bs, kv, d)
    v = torch.zeros(8 * bs, kv, d)
    k[slots], v[slots] = torch.randn(s, kv, d, generator=g), torch.randn(s, kv, d, generator=g)
    q = torch.randn(n, d, generator=g)
    k, v, q = k.to(dev), v.to(dev), q.to(dev)
    chunks = position_chunks(blocks, bs, 0, s)
    want = decode_gqa(
        q, heads_first_views(k, chunks, slots.to(dev)), heads_first_views(v, chunks, slots.to(dev)), 0.1
    )
    table = torch.tensor(blocks, dtype=torch.int32, device=dev)
    meta = torch.tensor([0, s], dtype=torch.int32, device=dev)
    got = paged_decode(q.view(kv, n // kv, d), k, v, table, meta, 0.1, bs)
    torch.testing.assert_close(got.reshape(1, -1), want, rtol=1e-4, atol=1e-4)

    print(
        "grouped_mm on cuda: bf16",
        grouped_mm_available(dev, torch.bfloat16),
        "fp32",
        grouped_mm_available(dev, torch.float32),
    )
    spec = MoESpec(8, 2, 64, "softmax_topk")  # type: ignore[arg-type]
    dtype = torch.bfloat16 if grouped_mm_available(dev, torch.bfloat16) else torch.float32
    experts = [
        ExpertWeights.packed({"gate_up": torch.randn(128, 256), "down": torch.randn(256, 64)}, dtype, dev)
        for _ in range(8)
    ]
    pool = ExpertSlots(experts[0], 8, 1, 8, dev)
    for e in (3, 1, 7, 0, 2, 6, 5, 4):
        pool.assign((0, e), experts[e])
    hidden = torch.randn(3, 256, device=dev, dtype=dtype)
    ids = torch.tensor([[0, 5], [2, 7], [5, 1]], device=dev)
    w = torch.rand(3, 2, device=dev, dtype=dtype)
    out, miss = pool.run(0, hidden, ids, w, spec)
    ref = dispatch_experts(lambda e, x: expert_forward(experts[e], x, spec), hidden, ids, w)
    assert not bool(miss)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())
