"""The engine on a CUDA device against transformers' own forward on the same device and weights,
for every supported architecture. Skipped without a GPU (these run on a GPU machine)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, PAD_TOKEN_ID, load_reference

from freetoken_agents.engine import Engine

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# GPU kernels reduce in another order than the CPU ones (and than each other's for other shapes):
# fp32 rounding differences, still far below what a wrong weight or mask would give (order 1).
CUDA_FP32_TOL = 1e-3


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _on_cuda(path) -> tuple[Engine, torch.nn.Module]:
    """The engine and transformers' model of the checkpoint at `path`, both on the GPU."""
    return Engine.from_pretrained(path, device="cuda"), load_reference(path).to("cuda")


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_prefill_and_decode_logits_match_transformers_on_cuda(arch, tiny_checkpoint):
    engine, ref = _on_cuda(tiny_checkpoint(arch))
    ids = _prompt(engine.spec.vocab_size, 30, seed=3)
    with torch.no_grad():
        expected = ref(torch.tensor([ids], device="cuda")).logits[0]
    with engine.new_session() as s:
        prefill = s.prefill(ids[:20])
        decoded = torch.stack([s.decode(t) for t in ids[20:]])
    got = torch.cat([prefill, decoded])
    assert got.device.type == "cuda"
    err = float((got - expected).abs().max() / expected.abs().max())
    print(f"{arch}: max abs logit error / logit scale on CUDA = {err:.2e}")
    assert err < CUDA_FP32_TOL


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_cuda_greedy_tokens_equal_transformers_generate_on_cuda(arch, tiny_checkpoint):
    engine, ref = _on_cuda(tiny_checkpoint(arch))
    ids = _prompt(engine.spec.vocab_size, 12, seed=2)
    with torch.no_grad():
        out = ref.generate(
            torch.tensor([ids], device="cuda"),
            do_sample=False,
            max_new_tokens=16,
            eos_token_id=None,
            pad_token_id=PAD_TOKEN_ID,
        )
    assert engine.generate(ids, max_new_tokens=16, stop_token_ids=()).token_ids == out[0, len(ids) :].tolist()


def test_cuda_sampling_draws_the_cpu_engines_tokens(tiny_checkpoint):
    """The bug: Sampler drew with a CPU generator from CUDA probabilities, which torch refuses
    ("Expected a 'cuda' device type for generator"); every temperature > 0 generation failed."""
    path = tiny_checkpoint("qwen3_moe")
    gpu, cpu = Engine.from_pretrained(path, device="cuda"), Engine.from_pretrained(path)
    ids = _prompt(gpu.spec.vocab_size, 12, seed=5)
    params = {"max_new_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 7, "stop_token_ids": ()}
    assert gpu.generate(ids, **params).token_ids == cpu.generate(ids, **params).token_ids
