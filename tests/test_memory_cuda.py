"""CUDA paths of the tiered expert memory: pinned tier 2, side-stream non_blocking copies timed by
events, compute waiting on the copy event, exact greedy output under a 25% budget. Skipped
without a GPU (the one allowed skip: these run on a GPU machine)."""

from __future__ import annotations

import time

import pytest
import torch

from freetoken_agents.engine import Engine
from freetoken_agents.engine.ftw.convert import convert_checkpoint
from freetoken_agents.engine.memory import BandwidthOracle, MemoryBudget, TieredExpertProvider
from freetoken_agents.engine.memory.oracle import cuda_timed_copy
from freetoken_agents.engine.options import TieringOptions

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_timed_copy_from_pinned_memory_is_async_and_measured():
    oracle = BandwidthOracle("host->fast")
    src = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True).fill_(7)  # 64 MiB
    assert src.is_pinned()
    stream = torch.cuda.Stream()
    dst = torch.empty(src.shape, dtype=src.dtype, device="cuda")
    for _ in range(4):
        t0 = time.perf_counter()
        done = cuda_timed_copy(oracle, dst, src, stream)
        launch_s = time.perf_counter() - t0
        torch.cuda.current_stream().wait_event(done)
        done.synchronize()
    assert launch_s < 0.01  # non_blocking: the host did not wait for 64 MiB
    assert bool((dst == 7).all())
    bw = oracle.estimate()  # polls the finished events
    assert oracle.samples == 4 and bw is not None and bw > 1e9
    print(f"pinned host->device bandwidth: {bw / 1e9:.1f} GB/s")


@pytest.fixture(scope="module")
def mixtral_ftw(tiny_checkpoint, tmp_path_factory):
    folder = tiny_checkpoint("mixtral")
    ftw = tmp_path_factory.mktemp("ftw") / "mixtral.ftw"
    convert_checkpoint(folder, ftw, quant="fp32", progress=False)
    return folder, ftw


@pytest.mark.parametrize("prefetch_thread", [False, True])
def test_cuda_tiered_provider_is_exact_under_tight_budget(mixtral_ftw, prefetch_thread):
    folder, ftw = mixtral_ftw
    ref = Engine.from_pretrained(folder, device="cuda")
    ws = TieredExpertProvider(ftw, MemoryBudget(), top_k=2, device="cuda").min_working_set
    all_bytes = ref.experts.nbytes  # type: ignore[attr-defined]
    fast = max(3 * ws, all_bytes // 4) + 8 * ref.kv_pool.bytes_per_block
    eng = Engine.from_pretrained(
        ftw,
        device="cuda",
        memory=MemoryBudget(fast_bytes=fast),
        placement="qstar",
        tiering=TieringOptions(prefetch_thread=prefetch_thread),
    )
    tp = eng.experts
    assert tp.cuda
    ids = [5, 3, 8, 1, 9, 2, 7, 4, 6, 0, 11, 12]
    want = ref.generate(ids, max_new_tokens=16, stop_token_ids=()).token_ids
    assert eng.generate(ids, max_new_tokens=16, stop_token_ids=()).token_ids == want
    torch.cuda.synchronize()
    s = tp.stats()
    assert s["bytes_moved"]["host->fast"] > 0
    assert s["bandwidth"]["host->fast"]["samples"] > 0  # CUDA events were folded in
    assert any(k.startswith("cuda/decoded") for k in s["policy"]["compute_ema_s"])  # event timings
    value = tp.host.peek(tp.host.keys()[0])
    assert value.storage.is_pinned()  # tier 2 on CUDA is page-locked host memory
    for key in tp.fast.keys():
        assert tp.fast.peek(key).storage.device.type == "cuda"
    # q* keeps the tiers exclusive: what tier 1 evicted was copied back into tier 2 (one
    # expert's bytes per eviction), and no expert takes room in both.
    evictions = s["tiers"]["fast"]["evictions"]
    assert s["exclusive_ram_tiers"]
    assert s["bytes_moved"]["fast->host"] == evictions * tp.fast_bytes[(0, 0)]
    assert not set(tp.fast.keys()) & set(tp.host.keys())
    tp.close()


def test_cuda_host_placement_moves_only_activations(mixtral_ftw):
    folder, ftw = mixtral_ftw
    ref = Engine.from_pretrained(folder, device="cuda")
    eng = Engine.from_pretrained(
        ftw, device="cuda", memory=MemoryBudget(), placement="qstar", tiering=TieringOptions(prefetch=False)
    )
    tp = eng.experts
    tp.policy.compute.set("cuda", "decoded", 1, 1.0)  # make tier-1 compute look expensive: HOST
    tp.policy.compute.set("cuda", "decoded", 2, 1.0)
    tp.fast.resize(tp.min_working_set)
    ids = [1, 2, 3, 4]
    want = ref.generate(ids, max_new_tokens=4, stop_token_ids=()).token_ids
    got = eng.generate(ids, max_new_tokens=4, stop_token_ids=()).token_ids
    assert got == want
    tp.close()
