"""CUDA paths of the tiered expert memory: pinned tier 2, side-stream non_blocking copies timed by
events, compute waiting on the copy event, exact greedy output under a 25% budget. Skipped
without a GPU (the one allowed skip: these run on a GPU machine)."""

from __future__ import annotations

import time

import pytest
import torch

from freetoken_agents.engine import Engine
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.memory import (
    BandwidthOracle,
    MemoryBudget,
    Placement,
    QStarPolicy,
    TieredExpertProvider,
)
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


def _tight_cuda_engine(ftw, ref: Engine, prefetch_thread: bool, **options) -> Engine:
    """A q* engine on CUDA with a quarter of the experts' bytes in tier 1 (at least three layers'
    working sets) plus room for 8 KV blocks."""
    ws = TieredExpertProvider(ftw, MemoryBudget(), top_k=2, device="cuda").min_working_set
    all_bytes = ref.experts.nbytes  # type: ignore[attr-defined]
    fast = max(3 * ws, all_bytes // 4) + 8 * ref.kv_pool.bytes_per_block
    tiering = TieringOptions(prefetch_thread=prefetch_thread)
    budget = MemoryBudget(fast_bytes=fast)
    return Engine.from_pretrained(
        ftw, device="cuda", memory=budget, placement="qstar", tiering=tiering, **options
    )


@pytest.mark.parametrize("prefetch_thread", [False, True])
def test_cuda_tiered_provider_is_exact_under_tight_budget(mixtral_ftw, prefetch_thread):
    folder, ftw = mixtral_ftw
    ref = Engine.from_pretrained(folder, device="cuda")
    eng = _tight_cuda_engine(ftw, ref, prefetch_thread)
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
    for key in tp.host.keys():  # tier 2 on CUDA is page-locked host memory: raw bytes or spilled
        value = tp.host.peek(key)
        assert (value if isinstance(value, torch.Tensor) else value.storage).is_pinned()
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


def _cpu_and_host_preferring_cuda_engines(ftw):
    """A resident CPU engine on `ftw`, and a tiered CUDA one (no prefetch) whose tier-1 compute
    looks expensive, so that q* computes its misses on the CPU (HOST), tier 1 at its minimum."""
    cpu = Engine.from_pretrained(ftw, device="cpu", dtype=torch.float32, placement="resident")
    eng = Engine.from_pretrained(
        ftw, device="cuda", dtype=torch.float32, memory=MemoryBudget(), placement="qstar",
        tiering=TieringOptions(prefetch=False),
    )  # fmt: skip
    eng.experts.policy.compute.set("cuda", "decoded", 1, 1.0)
    eng.experts.fast.resize(eng.experts.min_working_set)
    return cpu, eng


def test_cuda_host_placement_computes_int8_blocks_with_the_int8_kernel_on_the_cpu(
    tiny_checkpoint, tmp_path, kernel_calls
):
    """expert_quant "auto" on CUDA: tier 1 on the GPU holds decoded experts, but an int8 block q*
    runs on the CPU (HOST) is computed from its pinned int8 bytes by the fused kernel, as the
    resident CPU engine computes it (same tolerance as int8 vs fp32: bf16 activations)."""
    ftw = tmp_path / "mixtral-int8.ftw"
    folder = tiny_checkpoint("mixtral")
    convert_checkpoint(folder, ftw, quant="int8", progress=False, dense_dtype=torch.float32)
    cpu, eng = _cpu_and_host_preferring_cuda_engines(ftw)
    tp = eng.experts
    with cpu.new_session() as a:
        a.prefill([5, 3, 8, 1])
        want = [a.decode(tok) for tok in (9, 2, 7)]
    before = len(kernel_calls)  # from here on, only the tiered engine's HOST computes call it
    with eng.new_session() as b:
        b.prefill([5, 3, 8, 1])
        got = [b.decode(tok).cpu() for tok in (9, 2, 7)]
    for w, g in zip(want, got, strict=True):
        assert ((g - w).abs().max() / w.abs().max()) < 1e-2
    assert tp.stats()["policy"]["decisions_by_phase"].get("decode/host", 0) > 0
    assert len(kernel_calls) > before
    tp.close()


@pytest.fixture(scope="module")
def compact_ftws(tiny_checkpoint, tmp_path_factory):
    folder = tiny_checkpoint("mixtral")
    out = {}
    for quant in ("bf16", "fp8", "int8", "mxfp4"):
        out[quant] = tmp_path_factory.mktemp("ftw") / f"mixtral-{quant}.ftw"
        convert_checkpoint(folder, out[quant], quant=quant, progress=False)
    return out


def test_cuda_host_placement_computes_mxfp4_blocks_from_their_4_bit_bytes_under_auto(
    compact_ftws, monkeypatch
):
    """expert_quant "auto" on CUDA: tier 1 holds MXFP4 experts decoded, but one q* runs on the CPU
    (HOST) goes through the CPU's block decode (`mxfp4.cpu_linear`) from its pinned 4-bit bytes,
    never decoded whole first; the logits are the CPU engine's within device tolerance."""
    from freetoken_agents.engine.kernels import mxfp4

    ftw = compact_ftws["mxfp4"]
    cpu, eng = _cpu_and_host_preferring_cuda_engines(ftw)
    tp = eng.experts
    calls: list[tuple[int, ...]] = []
    real = mxfp4.cpu_linear

    def counting(x, blocks, scales):
        calls.append(tuple(blocks.shape))
        return real(x, blocks, scales)

    monkeypatch.setattr(mxfp4, "cpu_linear", counting)
    with cpu.new_session() as a:
        a.prefill([5, 3, 8, 1])
        want = [a.decode(tok) for tok in (9, 2, 7)]
    assert calls == []  # the resident CPU engine under "auto" holds MXFP4 experts decoded
    with eng.new_session() as b:
        b.prefill([5, 3, 8, 1])
        got = [b.decode(tok).cpu() for tok in (9, 2, 7)]
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert tp.stats()["policy"]["decisions_by_phase"].get("decode/host", 0) > 0
    assert calls  # HOST computes read the 4-bit bytes
    tp.close()


@pytest.mark.parametrize("quant", ["bf16", "fp8", "int8", "mxfp4"])
def test_compact_blocks_cross_the_link_and_decode_on_the_gpu(compact_ftws, quant):
    """Tier 2 holds the stored (compact) bytes; a STREAM copies exactly those and the GPU decodes
    them: the tier-1 weights equal the CPU decode of the same block bit for bit, and the logits
    equal a CPU engine's on the same file within fp32 device tolerance."""
    from freetoken_agents.engine.memory.weights import decode_block

    ftw = compact_ftws[quant]
    # expert_quant="none": the reference decodes every codec to fp32, as the GPU tier does
    cpu = Engine.from_pretrained(
        ftw, device="cpu", dtype=torch.float32, placement="resident", expert_quant="none"
    )
    eng = Engine.from_pretrained(
        ftw,
        device="cuda",
        dtype=torch.float32,
        memory=MemoryBudget(),
        placement="qstar",
        tiering=TieringOptions(prefetch=False),
        expert_quant="none",  # an expert q* runs on the CPU (HOST) is decoded too, not int8-computed
    )
    tp = eng.experts
    tp.fast.resize(tp.min_working_set * 2)  # streaming, with evictions
    prompt = [5, 3, 8, 1, 9, 2, 7, 4, 6, 0, 11, 12]
    want = cpu.new_session().prefill(prompt)
    got = eng.new_session().prefill(prompt).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize()
    raw = {k: tp.ftw.expert_info(*k).raw_length for k in tp.ftw.expert_keys()}
    (block,) = set(raw.values())  # one expert shape and codec: every copy is one compact block
    copies = tp.stats()["bytes_moved"]["host->fast"]
    assert copies > 0 and copies % block == 0
    for key in tp.fast.keys():
        w = tp.fast.peek(key)
        ref = decode_block(tp.ftw, key, tp.ftw.read_expert_bytes(*key), torch.float32)
        for name, t in w.tensors().items():
            assert t.device.type == "cuda"
            assert torch.equal(t.cpu(), getattr(ref, name)), (key, name)
    # Every codec here is compact next to fp32: tier 2 keeps the compact bytes (it holds more
    # experts than decoded ones would fill) and the GPU's decodes are timed for q*.
    assert tp.host.keys()
    for key in tp.host.keys():
        value = tp.host.peek(key)
        assert isinstance(value, torch.Tensor) and value.is_pinned()
        assert value.numel() == raw[key] < tp.fast_bytes[key]
    assert any(k.startswith(f"cuda/decode/{quant}") for k in tp.stats()["policy"]["compute_ema_s"])
    tp.close()


def test_corrupted_block_in_tier_2_or_on_disk_is_caught_before_use_on_cuda(compact_ftws, tmp_path):
    """A flipped byte on disk fails its checksum when read, before anything reaches tier 2 or
    the GPU (FTWFormatError naming the block), as on CPU."""
    import shutil

    from freetoken_agents.engine.errors import FTWFormatError
    from freetoken_agents.engine.ftw import FTWFile

    bad = tmp_path / "bad.ftw"
    shutil.copy(compact_ftws["mxfp4"], bad)
    with FTWFile(bad) as f:
        info = f.expert_info(0, 0)
    with open(bad, "r+b") as fh:
        fh.seek(info.data_offset + 10)
        byte = fh.read(1)
        fh.seek(info.data_offset + 10)
        fh.write(bytes([byte[0] ^ 0xFF]))
    eng = Engine.from_pretrained(
        bad, device="cuda", dtype=torch.float32, memory=MemoryBudget(), placement="qstar",
        tiering=TieringOptions(prefetch=False),
    )  # fmt: skip
    named = r"expert block \(layer=0, expert=0\) at byte offset \d+: checksum"
    with pytest.raises(FTWFormatError, match=named):
        eng.experts.get(0, 0)
    eng.experts.close()


@pytest.mark.parametrize("keep", [False, True])
def test_cuda_staged_copies_let_go_or_kept_give_the_resident_engines_tokens(mixtral_ftw, keep):
    """q*'s STAGED placement: a prefetch's staged copy is computed from and let go, so tier 1
    takes nothing from it, or (`keep`) it moves into a tier-1 slot of the recent segment
    (`RecentCopies`). Tokens equal the resident engine's either way."""
    from freetoken_agents.engine.memory import Placement, QStarPolicy

    class AlwaysStaged(QStarPolicy):
        def decide(self, key, case):
            if case.staged:
                self.decisions[Placement.STAGED.value] += 1
                return Placement.STAGED
            return super().decide(key, case)

    folder, ftw = mixtral_ftw
    ref = Engine.from_pretrained(folder, device="cuda")
    probe = TieredExpertProvider(ftw, MemoryBudget(), top_k=2, device="cuda")
    ws = probe.min_working_set
    probe.close()
    eng = Engine.from_pretrained(
        ftw,
        device="cuda",
        memory=MemoryBudget(fast_bytes=6 * ws + 8 * ref.kv_pool.bytes_per_block),
        placement="qstar",
        tiering=TieringOptions(prefetch_thread=False),
    )
    tp = eng.experts
    tp.policy.__class__ = AlwaysStaged  # same state, the staged copies always used once
    assert tp.spare_bytes == tp.prefetch_depth * ws  # staging room: 3 layers' top-2 (of 6 x ws)
    assert tp.planner.recent is not None
    if keep:
        tp.fast.set_recent_capacity(ws)  # two copies kept (12 tokens: no sizing window passes)
    ids = [5, 3, 8, 1, 9, 2, 7, 4]
    want = ref.generate(ids, max_new_tokens=12, stop_token_ids=()).token_ids
    assert eng.generate(ids, max_new_tokens=12, stop_token_ids=()).token_ids == want
    assert tp.policy.decisions[Placement.STAGED.value] > 0
    assert bool(tp.fast.recent) == keep and tp.fast.recent_used <= ws
    tp.close()


class _AlwaysSplit(QStarPolicy):
    """q* that splits every miss it may, half the down rows on the device."""

    def split_share(self, case):
        return 0.5 if case.can_split else 0.0

    def decide(self, key, case):
        if not case.resident and case.can_split:
            self.decisions[Placement.SPLIT.value] += 1
            return Placement.SPLIT
        return super().decide(key, case)


@pytest.mark.parametrize("quant", ["fp32", "int8", "mxfp4"])
def test_cuda_split_misses_give_the_resident_engines_tokens(tiny_checkpoint, tmp_path, quant):
    """SPLIT: the CPU computes gate/up and most down rows from the pinned tier-2 bytes while the
    last rows are copied and computed on the GPU; the greedy tokens are the resident engine's."""
    folder = tiny_checkpoint("mixtral")
    ftw = tmp_path / f"mixtral-{quant}.ftw"
    convert_checkpoint(folder, ftw, quant=quant, progress=False, dense_dtype=torch.float32)
    ref = Engine.from_pretrained(ftw, device="cuda", dtype=torch.float32, placement="resident")
    policy = _AlwaysSplit(
        BandwidthOracle("storage->host"), BandwidthOracle("host->fast"), BandwidthOracle("activations"),
        fast_device="cuda", host_device="cpu-host",
    )  # fmt: skip
    eng = Engine.from_pretrained(
        ftw, device="cuda", dtype=torch.float32, memory=MemoryBudget(), placement="qstar",
        tiering=TieringOptions(prefetch=False, policy=policy),
    )  # fmt: skip
    tp = eng.experts
    tp.fast.resize(tp.min_working_set)
    ids = [1, 2, 3, 4]
    want = ref.generate(ids, max_new_tokens=6, stop_token_ids=()).token_ids
    got = eng.generate(ids, max_new_tokens=6, stop_token_ids=()).token_ids
    assert got == want
    assert tp.policy.decisions["split"] > 0
    assert tp.stats()["bytes_moved"]["host->fast"] > 0
    tp.close()


def test_cuda_staging_room_follows_the_link_and_bounds_the_staged_copies(mixtral_ftw):
    """The spare buffer starts with room for every expert predicted for the next layers; once a
    layer time is measured it holds what the link can land meanwhile plus a layer's top-k, and no
    more copies than the room holds are staged at once."""
    folder, ftw = mixtral_ftw
    ref = Engine.from_pretrained(folder, device="cuda")
    ws = TieredExpertProvider(ftw, MemoryBudget(), top_k=2, device="cuda").min_working_set
    fast = max(8 * ws, ref.experts.nbytes // 2) + 8 * ref.kv_pool.bytes_per_block  # type: ignore[attr-defined]
    eng = Engine.from_pretrained(
        ftw, device="cuda", memory=MemoryBudget(fast_bytes=fast), placement="qstar",
        tiering=TieringOptions(prefetch_thread=False),
    )  # fmt: skip
    tp = eng.experts
    staged: list[tuple[int, int | None]] = []  # (copies waiting, room) after each copy staged
    should_stage = tp.planner.should_stage

    def spy(key):
        ok = should_stage(key)
        if ok:
            staged.append((len(tp.planner.arrives), tp.planner.room))
        return ok

    tp.planner.should_stage = spy
    eng.generate([1, 2, 3, 4], max_new_tokens=40, stop_token_ids=())
    assert tp.planner.layer_s > 0 and tp.spare_bytes > 0
    assert tp.planner.room == tp.spare_bytes // tp._staging_slot
    assert all(room is not None and waiting <= room for waiting, room in staged)
    tp.close()


def test_cuda_warm_start_fills_tier_1_and_pregates_in_one_pass(mixtral_ftw, tmp_path):
    """`routing_profile` on CUDA: tier 1 filled with the profile's most used experts while loading
    (device tensors, exclusive tiers), the tokens the resident engine's; pre-gating batched over
    the routers' one buffer on the device, equal to each router's own choice."""
    from freetoken_agents.engine.memory.pregate import pregate
    from freetoken_agents.engine.memory.routing_trace import RoutingRecord, write_trace

    folder, ftw = mixtral_ftw
    ref = Engine.from_pretrained(folder, device="cuda")
    layers = ref.spec.moe_layers()
    profile = tmp_path / "profile.jsonl"
    with profile.open("w") as f:
        write_trace(
            [RoutingRecord(0, t, lay, (1, 6), (0.5, 0.5), "decode") for t in range(4) for lay in layers], f
        )
    eng = _tight_cuda_engine(ftw, ref, False, routing_profile=profile)
    tp = eng.experts
    held = set(tp.fast.keys())
    assert held and held <= {(lay, e) for lay in layers for e in (1, 6)}
    assert all(tp.fast.peek(k).storage.device.type == "cuda" for k in held)
    assert not held & set(tp.host.keys())
    ahead = tp.ahead_routers
    assert ahead is not None and ahead.batched and ahead.weight.device.type == "cuda"
    h = torch.randn(1, ref.spec.hidden_size, device="cuda")
    assert ahead.choose(layers[0], h) == [pregate(tp.routers[n], h, 2) for n in layers[1:4]]
    ids = [5, 3, 8, 1, 9, 2, 7, 4, 6, 0, 11, 12]
    want = ref.generate(ids, max_new_tokens=16, stop_token_ids=()).token_ids
    assert eng.generate(ids, max_new_tokens=16, stop_token_ids=()).token_ids == want
    eng.close()


def test_cuda_a_layers_hidden_state_crosses_to_the_cpu_once(mixtral_ftw, monkeypatch):
    """Each HOST expert of a decode layer copied the layer's hidden state to the CPU again, a device
    sync that also waited for the tier-1 experts launched since; now once per layer. The tokens
    stay the resident CPU engine's (fp32)."""
    _, ftw = mixtral_ftw
    cpu, eng = _cpu_and_host_preferring_cuda_engines(ftw)
    tp = eng.experts
    calls, copies = [0], [0]
    on_host = type(tp)._on_host

    def counting(self, x):
        calls[0] += 1
        before = self._hidden_host
        out = on_host(self, x)
        copies[0] += self._hidden_host is not before
        return out

    monkeypatch.setattr(type(tp), "_on_host", counting)
    with cpu.new_session() as a:
        a.prefill([5, 3, 8, 1])
        want = [int(a.decode(tok).argmax()) for tok in (9, 2, 7)]
    with eng.new_session() as b:
        b.prefill([5, 3, 8, 1])
        calls[0] = copies[0] = 0
        got = [int(b.decode(tok).argmax()) for tok in (9, 2, 7)]
    assert got == want
    decode_layers = 3 * len(eng.spec.moe_layers())
    assert calls[0] > decode_layers  # layers with two HOST experts: the test has something to save
    assert copies[0] <= decode_layers
    tp.close()
