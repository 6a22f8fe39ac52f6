"""MXFP4 experts held in their 4-bit form (`expert_quant="compact"`, engine/kernels/mxfp4.py): the decode
path bit-equal to decoding at load, the engine resident and tiered on CPU, placement counting
compact bytes, and on a GPU (`-m cuda`) the GEMV kernel resident and in tier 1. The kernel's
arithmetic on CPU: tests/test_gemv_triton.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from freetoken_agents.engine import Engine, EngineError
from freetoken_agents.engine.ftw.codecs import get_codec
from freetoken_agents.engine.ftw.codecs.mxfp4 import mxfp4_scaled_pairs
from freetoken_agents.engine.kernels.mxfp4 import decode_weight, mxfp4_linear
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.loading.placement import expert_bytes
from freetoken_agents.engine.memory import MemoryBudget, TieredExpertProvider
from freetoken_agents.engine.memory.moves import shares_memory
from freetoken_agents.engine.options import TieringOptions

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = torch.randint(5, 400, (14,), generator=torch.Generator().manual_seed(7)).tolist()


def _encoded(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    enc = get_codec("mxfp4").encode(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 3)
    return enc.parts["blocks"].reshape(n, k // 2), enc.parts["scales"]


@pytest.mark.parametrize("tokens", [1, 5, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_path_is_bit_equal_to_decoding_at_load(tokens, dtype):
    blocks, scales = _encoded(24, 96)
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(24).to(dtype)
    w = decode_weight(blocks, scales, dtype)
    assert torch.equal(mxfp4_linear(x, blocks, scales, bias), F.linear(x, w) + bias)  # CPU: no kernel


def test_the_scaled_pair_table_holds_the_codecs_decode_of_every_byte_at_every_scale():
    blocks = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # row s: every byte once
    scales = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16)  # row s: scale s
    for dtype, as_int in ((torch.float32, torch.int64), (torch.bfloat16, torch.int32)):
        table = mxfp4_scaled_pairs(dtype, torch.device("cpu"))
        want = decode_weight(blocks, scales, dtype).contiguous().view(as_int).view(-1)
        assert torch.equal(table, want)  # bit patterns: NaN scale (255) included
    with pytest.raises(ValueError, match="float32 or bfloat16, not torch.float16"):
        mxfp4_scaled_pairs(torch.float16, torch.device("cpu"))  # the codec computes fp16 in fp32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1,), (5,), (2, 3)])
def test_the_cpu_path_decodes_a_row_block_at_a_time_with_the_codecs_values(monkeypatch, dtype, shape):
    """No float copy of the whole weight (it was decoded whole: 8 fp32 bytes written per stored
    byte, 5x slower at a Mixtral projection): each block of rows is the codec's decode."""
    from freetoken_agents.engine.kernels import mxfp4

    blocks, scales = _encoded(10, 96)
    w = decode_weight(blocks, scales, dtype)
    x = torch.randn(*shape, 96, generator=torch.Generator().manual_seed(2)).to(dtype)
    bias = torch.randn(10).to(dtype)
    monkeypatch.setattr(mxfp4, "DECODE_BLOCK", 4 * 96)  # blocks of 4, 4 and 2 rows

    def whole_decode(*args):
        raise AssertionError("the CPU path decoded the whole weight")

    monkeypatch.setattr(mxfp4, "decode_weight", whole_decode)
    want = torch.cat([F.linear(x, w[r : r + 4]) for r in (0, 4, 8)], dim=-1) + bias
    with torch.inference_mode():
        got_inference = mxfp4_linear(x, blocks, scales, bias)
    assert torch.equal(mxfp4_linear(x, blocks, scales, bias), want)  # scratch reused outside it
    assert torch.equal(got_inference, want) and want.dtype == dtype


@pytest.fixture(scope="module")
def mxfp4_ftw(tiny_checkpoint, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mxfp4") / "mixtral-mxfp4.ftw"
    convert_checkpoint(
        tiny_checkpoint("mixtral"), path, quant="mxfp4", progress=False, dense_dtype=torch.float32
    )
    return path


def _logits(engine: Engine) -> list[torch.Tensor]:
    with engine.new_session() as s:
        return [s.prefill(IDS[:8]), *(s.decode(t) for t in IDS[8:])]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_compact_experts_stay_4_bit_and_give_the_decoded_engines_logits(mxfp4_ftw):
    decoded = Engine.from_pretrained(mxfp4_ftw, expert_quant="none")
    compact = Engine.from_pretrained(mxfp4_ftw, expert_quant="compact")
    assert _same(_logits(decoded), _logits(compact))
    w = compact.experts.get(0, 0)
    assert (
        w.gate_up.dtype == torch.uint8
        and w.gate_up_scale is not None
        and w.gate_up_scale.dtype == torch.uint8
    )
    h = compact.spec.hidden_size
    assert w.gate_up.shape[1] == h // 2 and w.gate_up_scale.shape[1] == h // 32
    # ~0.53 bytes a weight: 7.5x fewer than fp32; the placement counts what will be held.
    fp32 = expert_bytes(compact.spec, torch.float32)
    assert compact.experts.resident_bytes() < fp32 / 7 and decoded.experts.resident_bytes() == fp32
    keys = compact.experts.keys()
    for key in keys:
        compact.experts.get(*key)
    held, counted = compact.experts.nbytes, compact.experts.resident_bytes()
    assert counted <= held <= counted + 4 * 64 * len(keys)  # each part padded to 64 bytes


def test_tiers_on_cpu_hold_mxfp4_blocks_without_a_decode_and_match_resident(mxfp4_ftw):
    ref = Engine.from_pretrained(mxfp4_ftw, expert_quant="compact")
    want = _logits(ref)
    probe = TieredExpertProvider(mxfp4_ftw, MemoryBudget(), top_k=2, expert_quant="compact")
    one, ws = probe.fast_bytes[(0, 0)], probe.min_working_set
    assert one <= probe.stored_bytes[(0, 0)]
    probe.close()
    kv = 4 * ref.kv_pool.bytes_per_block
    budget = MemoryBudget(fast_bytes=kv + max(ws, 3 * one), host_bytes=3 * one)
    eng = Engine.from_pretrained(
        mxfp4_ftw,
        memory=budget,
        placement="qstar",
        expert_quant="compact",
        tiering=TieringOptions(prefetch=False),
    )
    assert _same(want, _logits(eng))
    tp = eng.experts
    assert tp.stats()["tiers"]["fast"]["evictions"] > 0
    assert tp.moves.backing and all(
        tp.fast.peek(k).gate_up.dtype == torch.uint8
        and shares_memory(tp.fast.peek(k), tp.moves.backing[k][0])
        for k in tp.moves.backing
    )  # a promoted block moved up as it is stored: no decode, no copy
    eng.close()


def test_int8_files_count_int8_bytes_for_placement(tiny_checkpoint, tmp_path):
    path = tmp_path / "int8.ftw"
    convert_checkpoint(tiny_checkpoint("mixtral"), path, quant="int8", progress=False)
    auto = Engine.from_pretrained(path)
    fp32 = expert_bytes(auto.spec, torch.float32)
    assert auto.experts.resident_bytes() < fp32 / 3.5
    assert Engine.from_pretrained(path, expert_quant="none").experts.resident_bytes() == fp32


def test_compact_is_a_known_option_and_unknown_ones_are_refused(mxfp4_ftw):
    with pytest.raises(EngineError, match="expected one of auto, int8, compact, none"):
        Engine.from_pretrained(mxfp4_ftw, expert_quant="fp4")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compact_experts_on_the_gpu_decode_through_the_kernel(mxfp4_ftw):
    from freetoken_agents.engine.kernels.mxfp4 import kernel_ok

    cpu = Engine.from_pretrained(mxfp4_ftw, expert_quant="compact")
    gpu = Engine.from_pretrained(mxfp4_ftw, device="cuda", expert_quant="compact", placement="resident")
    assert kernel_ok(torch.device("cuda", torch.cuda.current_device()))
    assert gpu.experts.get(0, 0).gate_up.dtype == torch.uint8
    for a, b in zip(_logits(cpu), _logits(gpu), strict=True):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-4)
    blocks, scales = _encoded(300, 2048, seed=3)
    x = torch.randn(4, 2048, device="cuda")
    want = F.linear(x, decode_weight(blocks.cuda(), scales.cuda(), torch.float32))
    torch.testing.assert_close(mxfp4_linear(x, blocks.cuda(), scales.cuda()), want, rtol=1e-4, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compact_tier_1_on_the_gpu_keeps_the_bytes_that_crossed_the_link(mxfp4_ftw):
    """Tiered on CUDA with "compact": a STREAM copies the 4-bit block and tier 1 keeps it as it
    arrived (no decode, no float copy), its bytes stay in tier 2 (nothing moves up or spills)."""
    cpu = Engine.from_pretrained(mxfp4_ftw, expert_quant="compact")
    eng = Engine.from_pretrained(
        mxfp4_ftw, device="cuda", dtype=torch.float32, memory=MemoryBudget(), placement="qstar",
        expert_quant="compact", tiering=TieringOptions(prefetch=False),
    )  # fmt: skip
    tp = eng.experts
    tp.fast.resize(tp.min_working_set * 2)  # streaming, with evictions
    for a, b in zip(_logits(cpu), _logits(eng), strict=True):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize()
    raw = {k: tp.ftw.expert_info(*k).raw_length for k in tp.ftw.expert_keys()}
    (block,) = set(raw.values())
    copies = tp.stats()["bytes_moved"]["host->fast"]
    assert copies > 0 and copies % block == 0 and not tp.moves.moves_up
    assert tp.stats()["tiers"]["fast"]["evictions"] > 0
    for key in tp.fast.keys():
        w = tp.fast.peek(key)
        assert w.gate_up.device.type == "cuda" and w.gate_up.dtype == torch.uint8
        assert tp.fast_bytes[key] == raw[key]
    tp.close()
