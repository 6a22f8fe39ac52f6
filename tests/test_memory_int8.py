"""Int8 experts under the tiered memory (CPU): tier 1 and HOST compute keep int8 projections in
int8 as the resident engine does (`expert_quant`), so the logits equal the resident engine's on the
same file whatever the budget, an int8 expert takes a quarter of an fp32 one's room in tier 1, and
an int8 block moves between the RAM tiers without a copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken_agents.engine import Engine, EngineError
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.memory import MemoryBudget, TieredExpertProvider
from freetoken_agents.engine.memory.moves import shares_memory
from freetoken_agents.engine.options import TieringOptions

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = torch.randint(5, 400, (14,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def files(tiny_checkpoint, tmp_path_factory):
    """arch -> (int8 FTW, fp32 FTW) of the same tiny checkpoint."""
    cache: dict[str, tuple[Path, Path]] = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in cache:
            folder, out = tiny_checkpoint(arch), tmp_path_factory.mktemp("int8")
            paths = []
            for quant in ("int8", "fp32"):
                path = out / f"{arch}-{quant}.ftw"
                convert_checkpoint(folder, path, quant=quant, progress=False, dense_dtype=torch.float32)
                paths.append(path)
            cache[arch] = (paths[0], paths[1])
        return cache[arch]

    return get


def _top_k(eng: Engine) -> dict[int, int]:
    return {i: eng.spec.layers[i].moe.top_k for i in eng.spec.moe_layers()}  # type: ignore[union-attr]


def _tier1(tp: TieredExpertProvider) -> list:
    return [tp.fast.peek(k) for k in tp.fast.keys()]


def _logits(engine: Engine) -> list[torch.Tensor]:
    with engine.new_session() as s:
        out = [s.prefill(IDS[:8])]
        out += [s.decode(t) for t in IDS[8:]]
    return out


def _tight(ftw: Path, ref: Engine, fraction: float, room: int | None = None, **kw) -> Engine:
    """`ftw` tiered with tier 1 at `fraction` of its experts' tier-1 bytes, or `room` bytes (at
    least one layer's working set), and tier 2 for two blocks: experts are evicted and read again."""
    quant = kw.get("expert_quant", "auto")
    probe = TieredExpertProvider(ftw, MemoryBudget(), top_k=_top_k(ref), expert_quant=quant)
    kv = 4 * ref.kv_pool.bytes_per_block
    room = int(fraction * sum(probe.fast_bytes.values())) if room is None else room
    fast = kv + max(probe.min_working_set, room)
    host = 2 * max(probe.stored_bytes.values())
    probe.close()
    placement = kw.pop("placement", "qstar")
    tiering = TieringOptions(prefetch_thread=False)
    return Engine.from_pretrained(
        ftw, memory=MemoryBudget(fast_bytes=fast, host_bytes=host), placement=placement, tiering=tiering, **kw
    )


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("placement", ["qstar", "stream"])
def test_tiered_int8_file_computes_int8_and_equals_the_resident_engine(arch, placement, files, kernel_calls):
    """The bug: the tiered provider decoded int8 blocks to the compute dtype while the resident
    engine ("auto") kept them int8, so the same file gave different logits under a budget."""
    int8_ftw, _ = files(arch)
    ref = Engine.from_pretrained(int8_ftw)
    want = _logits(ref)
    resident_calls = len(kernel_calls)
    assert resident_calls > 0  # the resident engine runs the fused kernel on decode
    eng = _tight(int8_ftw, ref, 0.3, placement=placement)
    tp = eng.experts
    got = _logits(eng)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert len(kernel_calls) > resident_calls  # the tiered engine ran it too
    assert all(w.gate_up.dtype == torch.int8 and w.down.dtype == torch.int8 for w in _tier1(tp))
    s = tp.stats()["tiers"]
    assert s["fast"]["evictions"] > 0 and s["storage"]["reads"] > len(tp.stored_bytes)  # really tight
    assert s["fast"]["used_bytes"] <= s["fast"]["capacity_bytes"]
    eng.close()
    ref.close()


def test_int8_blocks_move_between_the_ram_tiers_without_a_copy(files):
    """q*'s exclusive RAM tiers: a promoted int8 block's tier-1 weights are views of its stored
    bytes (it leaves tier 2), and an evicted one goes back to tier 2; no expert is in both."""
    int8_ftw, _ = files("mixtral")
    tp = TieredExpertProvider(int8_ftw, MemoryBudget(), top_k=2, prefetch=False)
    one = tp.fast_bytes[(0, 0)]
    tp.close()
    tp = TieredExpertProvider(
        int8_ftw, MemoryBudget(fast_bytes=2 * one, host_bytes=4 * one), top_k=2, prefetch=False
    )
    keys = [(0, 0), (0, 1), (0, 2), (0, 3)]
    for k in keys:
        w = tp.get(*k)
        assert w.gate_up.dtype == torch.int8 and shares_memory(w, tp.moves.backing[k][0])
    assert sorted(tp.fast.keys()) == keys[2:] and sorted(tp.host.keys()) == keys[:2]  # demoted
    assert not set(tp.fast.keys()) & set(tp.host.keys())
    read = tp.stats()["file_bytes_read"]
    for k in keys:  # all four are still in RAM
        tp.get(*k)
    assert tp.stats()["file_bytes_read"] == read
    tp.close()


def test_an_int8_expert_takes_a_quarter_of_the_room_so_tier_1_holds_more(files):
    int8_ftw, fp32_ftw = files("mixtral")
    ref = Engine.from_pretrained(int8_ftw)
    auto = TieredExpertProvider(int8_ftw, MemoryBudget(), top_k=_top_k(ref))
    none = TieredExpertProvider(int8_ftw, MemoryBudget(), top_k=_top_k(ref), expert_quant="none")
    fp32 = TieredExpertProvider(fp32_ftw, MemoryBudget(), top_k=_top_k(ref))
    fp32_total = sum(fp32.fast_bytes.values())
    for k in auto.fast_bytes:
        assert none.fast_bytes[k] == fp32.fast_bytes[k]
        assert auto.fast_bytes[k] < 0.3 * fp32.fast_bytes[k]
        assert auto.fast_bytes[k] <= auto.stored_bytes[k]  # the stored block: weights + row scales
        assert auto.get(*k).nbytes <= auto.fast_bytes[k]
    for p in (auto, none, fp32):
        p.close()
    # One fast budget: the int8 engine keeps ~4x more experts in tier 1 than the decoded one.
    held = {}
    for quant in ("auto", "none"):
        eng = _tight(int8_ftw, ref, 0, room=fp32_total // 8, expert_quant=quant)
        _logits(eng)
        held[quant] = len(eng.experts.fast.keys())
        eng.close()
    assert held["auto"] >= 3 * held["none"]
    ref.close()


def test_host_compute_runs_the_int8_kernel_on_the_stored_bytes(files, kernel_calls):
    int8_ftw, _ = files("mixtral")
    ref = Engine.from_pretrained(int8_ftw)
    want = _logits(ref)
    eng = _tight(int8_ftw, ref, 0.1)
    tp = eng.experts
    tp.policy.compute.set("cpu", "decoded", 1, 1.0)  # tier-1 compute looks slow: q* picks HOST
    before = len(kernel_calls)
    got = _logits(eng)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    assert tp.stats()["policy"]["decisions_by_phase"].get("decode/host", 0) > 0
    assert len(kernel_calls) > before
    eng.close()
    ref.close()


@pytest.mark.parametrize(
    ("mode", "quant", "arch"), [("int8", "fp32", "qwen3_moe"), ("none", "int8", "mixtral")]
)
def test_expert_quant_int8_and_none_hold_tier_1_as_the_resident_engine_does(mode, quant, arch, files):
    """ "int8": float blocks are quantized into tier 1 (the fp32 bytes stay in tier 2); "none":
    int8 blocks are decoded to fp32. Either way the logits are the resident engine's."""
    int8_ftw, fp32_ftw = files(arch)
    ftw = int8_ftw if quant == "int8" else fp32_ftw
    ref = Engine.from_pretrained(ftw, expert_quant=mode)
    eng = _tight(ftw, ref, 0.3, expert_quant=mode)
    assert all(torch.equal(a, b) for a, b in zip(_logits(ref), _logits(eng), strict=True))
    tier1 = _tier1(eng.experts)
    assert tier1 and all(w.is_quantized == (mode == "int8") for w in tier1)
    if mode == "int8":
        assert not eng.experts.moves.backing
    eng.close()
    ref.close()


def test_unknown_expert_quant_is_refused_by_the_tiered_provider(files):
    int8_ftw, _ = files("mixtral")
    with pytest.raises(EngineError, match="unknown expert_quant 'int4'"):
        TieredExpertProvider(int8_ftw, MemoryBudget(), top_k=2, expert_quant="int4")
