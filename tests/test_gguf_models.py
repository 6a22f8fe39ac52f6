"""Engine logits on tiny GGUF models against transformers, per architecture and expert GGUF type.

References (float32 both sides, so the bound is float32 rounding, not quantization):

- qwen3_moe, qwen2_moe: transformers' own GGUF loader on the SAME file
  (`AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`; its GGUF config mapping lacks the
  expert widths, passed as overrides), and also the reference folder below.
- mixtral (a "llama" GGUF with experts), olmoe, gpt_oss, deepseek_v3 ("deepseek2"): transformers
  cannot load these GGUFs as MoE models (deepseek2 not at all), so the reference is transformers on
  a checkpoint folder whose weights are the GGUF's tensors dequantized by `gguf.quants.dequantize`
  and mapped back to Hugging Face names (llama q/k un-permuted, deepseek2's split attn_k_b /
  attn_v_b joined back into kv_b_proj), written by `gguf_models.write_gguf` independently of the
  engine's mapping.

deepseek_v3: one dense leading layer, a shared expert, 4 groups of 2 routed experts; the Q4_K case
(hidden size 256) also has YaRN rope with mscale (``rope.scaling.yarn_log_multiplier``).
"""

from __future__ import annotations

import logging

import pytest
import torch
from gguf_models import load_folder_reference, load_gguf_reference, write_gguf

from freetoken_agents.engine import Engine
from freetoken_agents.engine.ftw import FTWFile
from freetoken_agents.engine.loading.gguf import convert_gguf

TOL = 1e-5  # max |logit diff| / max |logit|, float32 rounding only
CASES = [
    ("qwen3_moe", "Q8_0"),
    ("qwen3_moe", "Q4_K"),
    ("qwen2_moe", "Q4_0"),
    ("qwen2_moe", "Q8_0"),
    ("mixtral", "Q8_0"),
    ("mixtral", "Q4_1"),
    ("gpt_oss", "MXFP4"),
    ("olmoe", "Q4_K+Q6_K"),
    ("deepseek_v3", "Q8_0"),
    ("deepseek_v3", "Q4_K"),
]
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)
OVERRIDES = {("deepseek_v3", "Q4_K"): dict(rope_parameters=YARN)}
EXPECTED_CODECS = {
    "Q8_0": {"int8_b32"},
    "Q4_0": {"uint4_b32"},
    "Q4_1": {"uint4_b32"},
    "Q4_K": {"uint4_b32"},
    "Q4_K+Q6_K": {"uint4_b32", "fp32"},
    "MXFP4": {"mxfp4"},
}
logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict = {}

    def get(arch: str, qtype: str):
        if (arch, qtype) not in cache:
            folder = tmp_path_factory.mktemp(f"{arch}-{qtype.replace('+', '_')}")
            tiny = write_gguf(arch, folder, expert_type=qtype, **OVERRIDES.get((arch, qtype), {}))
            out = folder / "model.ftw"
            convert_gguf(tiny.path, out, progress=False)
            cache[(arch, qtype)] = (tiny, out, Engine.from_pretrained(out))
        return cache[(arch, qtype)]

    return get


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 480, (n,), generator=g).tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize(("arch", "qtype"), CASES)
def test_prefill_and_decode_logits_match_transformers(arch, qtype, built):
    tiny, out, engine = built(arch, qtype)
    with FTWFile(out) as f:
        codecs = {t.codec for k in f.expert_keys() for n, t in f.expert_info(*k).tensors.items()}
    assert codecs - {"fp32"} <= EXPECTED_CODECS[qtype] and EXPECTED_CODECS[qtype] <= codecs | {"fp32"}
    ids = _ids(36, 1)
    refs = [load_folder_reference(tiny)]
    if arch in ("qwen3_moe", "qwen2_moe"):
        refs.append(load_gguf_reference(tiny))
    with engine.new_session() as s:
        prefill = s.prefill(ids[:20])
        decoded = torch.stack([s.decode(t) for t in ids[20:]])
    got = torch.cat([prefill, decoded])
    for ref in refs:
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        diff = _rel(got, expected)
        logger.warning(
            "gguf %s %s: max |logit diff| %.3g (rel %.3g)", arch, qtype, diff * expected.abs().max(), diff
        )
        assert diff < TOL, (arch, qtype, diff)


def test_transformers_gguf_loader_equals_the_dequantized_folder(built):
    """The two references agree: the test writer maps tensors as llama.cpp does."""
    tiny, _, _ = built("qwen2_moe", "Q8_0")
    ids = torch.tensor([_ids(24, 2)])
    with torch.no_grad():
        a = load_gguf_reference(tiny)(ids).logits
        b = load_folder_reference(tiny)(ids).logits
    assert torch.equal(a, b)


def test_dense_tensors_keep_exact_values(built):
    tiny, out, _ = built("mixtral", "Q8_0")
    with FTWFile(out) as f:
        q = f.dense("layers.0.self_attn.q_proj.weight")
        k = f.dense("layers.1.self_attn.k_proj.weight")
        emb = f.dense("embed_tokens.weight")
    assert torch.equal(q, tiny.reference["model.layers.0.self_attn.q_proj.weight"])  # un-permuted
    assert torch.equal(k, tiny.reference["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(emb, tiny.reference["model.embed_tokens.weight"])  # F16 widened exactly
