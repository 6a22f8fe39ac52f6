"""Already-quantized checkpoints: gpt-oss MXFP4 and DeepSeek-V3 fp8 load in the HF-folder engine
(dequantized exactly, never read as floats) and convert to FTW without re-quantizing (stored bytes
compared bit for bit).

The tiny checkpoints are made here from the fp32 tiny models: experts (and for DeepSeek every linear
projection) are quantized with the FTW codecs and written in the real checkpoints' on-disk layouts;
the other tensors are cast to bf16 as in the real releases. A second folder holds the same weights
dequantized to plain float tensors: the reference that transformers and the engine load normally.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import TOKENIZER_VOCAB_SIZE, load_reference

from freetoken_agents.engine import CheckpointError, Engine
from freetoken_agents.engine.adapters.gpt_oss import deinterleave_rows
from freetoken_agents.engine.ftw import FTWFile, decode, encode
from freetoken_agents.engine.loading.convert import convert_checkpoint

FP32_TOL = 1e-4  # max abs diff relative to the logit scale, as in test_engine_reference


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TOKENIZER_VOCAB_SIZE, (n,), generator=g).tolist()


def _prefill(engine: Engine, ids: list[int]) -> torch.Tensor:
    with engine.new_session() as s:
        return s.prefill(ids)


def aligned(engine: Engine) -> Engine:
    """Own, 64-byte aligned memory for every dense weight (see test_ftw_convert.aligned: CPU GEMV
    results depend on the weights' alignment, and FTW aligns what safetensors does not)."""
    for t in [*engine.model.parameters(), *engine.model.buffers()]:
        t.data = t.data.clone()
    return engine


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _write(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quantization: dict | None) -> Path:
    shutil.copytree(src, dst)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if quantization is not None:
        cfg["quantization_config"] = quantization
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _bf16(name: str, t: torch.Tensor) -> torch.Tensor:
    return t if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tiny_checkpoint, tmp_path_factory):
    """(MXFP4 folder, dequantized reference folder, the stored blocks/scales by tensor name)."""
    src = tiny_checkpoint("gpt_oss")
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    quant, ref = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # [E, in, out] on disk; MXFP4 stores [E, out, in/32, 16] with gate/up rows interleaved
            encs = [encode(t[e].T.contiguous(), "mxfp4") for e in range(t.shape[0])]
            quant[name + "_blocks"] = torch.stack([x.parts["blocks"] for x in encs])
            quant[name + "_scales"] = torch.stack([x.parts["scales"] for x in encs])
            ref[name] = torch.stack([decode(x).T.contiguous() for x in encs])
        else:
            quant[name] = ref[name] = _bf16(name, t)
    q = _write(src, root / "mxfp4", quant, {"quant_method": "mxfp4"})
    return q, _write(src, root / "ref", ref, None), quant


@pytest.fixture(scope="module")
def deepseek_fp8(tiny_checkpoint, tmp_path_factory):
    """(fp8 folder, dequantized reference folder, the stored tensors by name)."""
    src = tiny_checkpoint("deepseek_v3")
    root = tmp_path_factory.mktemp("deepseek_fp8")
    quant, ref = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        # DeepSeek-V3 quantizes every linear projection (experts, shared experts, dense MLP and
        # attention); embeddings, norms, lm_head and the router stay as they are.
        if name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            x = encode(t, "fp8_e4m3")  # tiny dims: one 128x128 block, scale grid [1, 1]
            quant[name], quant[name + "_scale_inv"] = x.parts["weight"], x.parts["scale_inv"]
            ref[name] = decode(x)
        else:
            quant[name] = ref[name] = _bf16(name, t)
    fp8_config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    return _write(src, root / "fp8", quant, fp8_config), _write(src, root / "ref", ref, None), quant


@pytest.mark.parametrize("which", ["gpt_oss_mxfp4", "deepseek_fp8"])
def test_hf_folder_engine_dequantizes_exactly(which, request):
    qdir, refdir, _ = request.getfixturevalue(which)
    ids = _prompt(24, seed=0)
    got = _prefill(aligned(Engine.from_pretrained(qdir)), ids)
    # Dequantization is exact in fp32: the quantized folder and the dequantized one are the same model.
    assert torch.equal(got, _prefill(aligned(Engine.from_pretrained(refdir)), ids))
    with torch.no_grad():
        expected = load_reference(refdir)(torch.tensor([ids])).logits[0]
    assert float((got - expected).abs().max() / expected.abs().max()) < FP32_TOL


def test_gpt_oss_mxfp4_blocks_are_carried_over(gpt_oss_mxfp4, tmp_path):
    qdir, _, stored = gpt_oss_mxfp4
    out = tmp_path / "gpt_oss.ftw"
    report = convert_checkpoint(qdir, out, quant="mxfp4", progress=False)
    assert report.carried_over == 2 * 3 * 8 and report.codec_counts == {"mxfp4": 48}
    assert report.bias_codec_counts == {"bf16": 48}
    with FTWFile(out) as f:
        assert f.metadata["source_quantization_config"] == {"quant_method": "mxfp4"}
        assert "quantization_config" not in f.model_config
        for layer, e in f.expert_keys():
            enc = f.encoded_expert(layer, e)
            base = f"model.layers.{layer}.mlp.experts"
            gu_b, gu_s = stored[f"{base}.gate_up_proj_blocks"][e], stored[f"{base}.gate_up_proj_scales"][e]
            # the only change: rows (g0, u0, g1, u1, ...) -> (g0, g1, ..., u0, u1, ...)
            assert torch.equal(enc["gate_up"].parts["blocks"], deinterleave_rows(gu_b))
            assert torch.equal(enc["gate_up"].parts["scales"], deinterleave_rows(gu_s))
            assert torch.equal(enc["down"].parts["blocks"], stored[f"{base}.down_proj_blocks"][e])
            assert torch.equal(enc["down"].parts["scales"], stored[f"{base}.down_proj_scales"][e])
            bias = stored[f"{base}.gate_up_proj_bias"][e]
            assert torch.equal(enc["gate_up_bias"].parts["weight"], deinterleave_rows(bias))
    # Same weights, same numbers: the FTW engine equals the MXFP4 folder's engine bit for bit.
    ids = _prompt(16, seed=1)
    hf = aligned(Engine.from_pretrained(qdir))
    assert torch.equal(_prefill(Engine.from_pretrained(out), ids), _prefill(hf, ids))


def test_deepseek_fp8_bytes_and_scales_are_carried_over(deepseek_fp8, tmp_path):
    qdir, _, stored = deepseek_fp8
    out = tmp_path / "deepseek.ftw"
    report = convert_checkpoint(qdir, out, quant="fp8", progress=False)
    assert report.carried_over == 2 * 8 * 3 and report.codec_counts == {"fp8_e4m3": 48}
    with FTWFile(out) as f:
        for layer, e in f.expert_keys():
            enc = f.encoded_expert(layer, e)
            for proj in ("gate", "up", "down"):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"
                assert torch.equal(_u8(enc[proj].parts["weight"]), _u8(stored[name]))
                assert torch.equal(enc[proj].parts["scale_inv"], stored[name + "_scale_inv"])
        # fp8 dense weights are carried over too, with their scale grid next to them.
        name = "layers.1.self_attn.q_b_proj.weight"
        assert f.dense_info(name).dtype == "float8_e4m3fn"
        assert torch.equal(_u8(f.dense(name)), _u8(stored["model." + name]))
        assert torch.equal(f.dense(name + "_scale_inv"), stored["model." + name + "_scale_inv"])
        assert f.dense_info("layers.1.mlp.router.e_score_correction_bias").dtype == "float32"
    ids = _prompt(16, seed=2)
    hf = aligned(Engine.from_pretrained(qdir))
    ftw = Engine.from_pretrained(out)
    assert torch.equal(_prefill(ftw, ids), _prefill(hf, ids))
    with hf.new_session() as a, ftw.new_session() as b:
        a.prefill(ids[:8])
        b.prefill(ids[:8])
        for t in ids[8:]:
            assert torch.equal(b.decode(t), a.decode(t))


def test_requantizing_a_prequantized_checkpoint(deepseek_fp8, gpt_oss_mxfp4, tmp_path):
    # fp8 -> bf16 decodes first; gpt-oss MXFP4 -> bf16 is exact (E2M1 x 2^k fits in bf16).
    report = convert_checkpoint(deepseek_fp8[0], tmp_path / "d.ftw", quant="int8", progress=False)
    assert report.carried_over == 0 and report.codec_counts == {"int8": 32}
    qdir = gpt_oss_mxfp4[0]
    convert_checkpoint(qdir, tmp_path / "g.ftw", quant="bf16", progress=False)
    ids = _prompt(12, seed=3)
    expected = _prefill(Engine.from_pretrained(qdir, dtype=torch.bfloat16), ids)
    assert torch.equal(
        _prefill(Engine.from_pretrained(tmp_path / "g.ftw", dtype=torch.bfloat16), ids), expected
    )


def test_fp8_weight_without_its_scales_is_an_error(deepseek_fp8, tmp_path):
    qdir, _, stored = deepseek_fp8
    broken = dict(stored)
    del broken["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    bad = _write(qdir, tmp_path / "bad", broken, None)
    with pytest.raises(CheckpointError, match=r"o_proj\.weight.*no .*weight_scale_inv"):
        Engine.from_pretrained(bad)
    with pytest.raises(CheckpointError, match="weight_scale_inv"):
        convert_checkpoint(bad, tmp_path / "bad.ftw", quant="fp8", progress=False)
    assert not (tmp_path / "bad.ftw").exists()
