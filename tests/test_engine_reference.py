"""Engine logits and greedy tokens against transformers' own forward on the same weights."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, PAD_TOKEN_ID, load_reference

from freetoken_agents.engine import Engine

FP32_TOL = 1e-4  # max abs diff relative to the logit scale (max |logit|)
# bf16 stores weights and activations in 8 bits of mantissa; the reference rounds at different
# points (e.g. routing weights, softmax), so the documented bound is 5% of the logit scale.
BF16_TOL = 5e-2


def _prompt(vocab: int, n: int = 24, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            path = tiny_checkpoint(arch)
            cache[arch] = (Engine.from_pretrained(path), load_reference(path))
        return cache[arch]

    return get


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(arch, loaded):
    engine, ref = loaded(arch)
    ids = _prompt(engine.spec.vocab_size, 40)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    with engine.new_session() as s:
        got = s.prefill(ids)
    assert got.shape == expected.shape
    assert _rel_err(got, expected) < FP32_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_logits_match_transformers(arch, loaded):
    engine, ref = loaded(arch)
    ids = _prompt(engine.spec.vocab_size, 36, seed=1)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    with engine.new_session() as s:
        s.prefill(ids[:20])
        decoded = torch.stack([s.decode(t) for t in ids[20:]])
    assert _rel_err(decoded, expected[20:]) < FP32_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers_generate(arch, loaded):
    engine, ref = loaded(arch)
    ids = _prompt(engine.spec.vocab_size, 12, seed=2)
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([ids]),
            do_sample=False,
            max_new_tokens=16,
            eos_token_id=None,
            pad_token_id=PAD_TOKEN_ID,
        )
    expected = out[0, len(ids) :].tolist()
    result = engine.generate(ids, max_new_tokens=16, stop_token_ids=())
    assert result.token_ids == expected
    assert result.finish_reason == "length"


@pytest.mark.parametrize("arch", ARCHS)
def test_truncate_then_decode_equals_fresh_prefill(arch, loaded):
    engine, _ = loaded(arch)
    ids = _prompt(engine.spec.vocab_size, 37, seed=3)  # crosses block boundaries (16 tokens)
    other = _prompt(engine.spec.vocab_size, 10, seed=4)
    with engine.new_session() as s, engine.new_session() as fresh:
        s.prefill(ids + other)
        s.truncate(21)
        got = torch.stack([s.decode(t) for t in ids[21:]])
        expected = fresh.prefill(ids)[21:]
        assert s.token_ids == ids
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_fork_does_not_disturb_parent(arch, loaded):
    engine, _ = loaded(arch)
    ids = _prompt(engine.spec.vocab_size, 19, seed=5)  # partial last block: forces copy-on-write
    with engine.new_session() as parent:
        parent.prefill(ids)
        child = parent.fork()
        child.prefill(_prompt(engine.spec.vocab_size, 9, seed=6))
        after_child = parent.decode(7)
        child.close()
    with engine.new_session() as fresh:
        expected = fresh.prefill([*ids, 7])[-1]
    assert torch.allclose(after_child, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_bfloat16_within_documented_tolerance(arch, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    engine = Engine.from_pretrained(path, dtype=torch.bfloat16)
    ref = load_reference(path, dtype=torch.bfloat16)
    ids = _prompt(engine.spec.vocab_size, 24, seed=7)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].float()
    with engine.new_session() as s:
        got = s.prefill(ids).float()
    assert got.dtype == torch.float32 and engine.dtype == torch.bfloat16
    assert _rel_err(got, expected) < BF16_TOL
