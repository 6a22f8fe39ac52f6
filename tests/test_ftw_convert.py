"""HF folder -> FTW conversion: exact round trips, lossy-codec error bounds, lazy expert reads,
the auto (hot/cold) policy and bad input through `Engine.from_pretrained("x.ftw")`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import ARCHS, TOKENIZER_VOCAB_SIZE, build_tiny_model

from freetoken_agents.engine import CheckpointError, Engine, FTWFormatError
from freetoken_agents.engine.ftw import FTWFile, FTWWriter
from freetoken_agents.engine.loading.calibrate import AutoPolicy, RoutingCounter
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.loading.ftw_provider import FTWExpertProvider

# Median over positions of the per-position relative L2 logit error ||ftw - fp32|| / ||fp32||, two
# 32-token prompts, dense tensors stored by the default policy (bf16). Measured on the tiny models
# (Dec 2026, torch 2.13 CPU), per arch mixtral / qwen2_moe / qwen3_moe / olmoe / deepseek_v3 / gpt_oss:
#   bf16   3.8e-3 4.1e-3 4.0e-3 4.2e-3 4.1e-3 4.6e-3
#   int8   4.6e-3 4.4e-3 4.7e-3 4.4e-3 5.9e-3 8.5e-3
#   fp8    1.3e-2 8.5e-3 1.3e-2 1.2e-2 2.2e-2 3.6e-2   (one 128x128 scale covers a whole tiny matrix)
#   mxfp4  5.6e-2 3.3e-2 5.9e-2 4.4e-2 9.7e-2 1.5e-1
# The max-abs metric of the reference tests (max |diff| / max |logit|) is dominated by tokens whose
# top-k routing flips on random tiny models (e.g. gpt_oss bf16 0.11, mxfp4 0.72), so bounds use the
# median. Bounds: about 2x the worst measured value.
CODEC_BOUNDS = {"bf16": 1e-2, "int8": 2e-2, "fp8": 8e-2, "mxfp4": 0.3}


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TOKENIZER_VOCAB_SIZE, (n,), generator=g).tolist()


def _prefill(engine: Engine, ids: list[int]) -> torch.Tensor:
    with engine.new_session() as s:
        return s.prefill(ids)


def aligned(engine: Engine) -> Engine:
    """Give every dense weight of `engine` its own (64-byte aligned) memory; returns `engine`.

    The HF-folder engine computes on views of the safetensors mmap, whose data start at an arbitrary
    8-byte offset; FTW dense tensors start on 64-byte boundaries. CPU GEMV kernels (decode steps)
    sum in an alignment-dependent order, so the same weights at different alignments differ in the
    last bit. Bit-exact comparisons therefore put both engines' weights on equal alignment.
    """
    for t in [*engine.model.parameters(), *engine.model.buffers()]:
        t.data = t.data.clone()
    return engine


def _median_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((got - ref).norm(dim=-1) / ref.norm(dim=-1)).median())


@pytest.fixture(scope="module")
def converted(tiny_checkpoint, tmp_path_factory):
    """`converted(arch, quant, **kw)` -> path of the FTW conversion (cached per module)."""
    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("ftw")

    def get(arch: str, quant: str, **kw) -> Path:
        key = (arch, quant, *sorted(kw.items()))
        if key not in cache:
            out = root / f"{arch}-{quant}-{len(cache)}.ftw"
            convert_checkpoint(
                tiny_checkpoint(arch),
                out,
                quant=quant,
                progress=False,
                open_model=Engine.for_calibration,
                **kw,
            )
            cache[key] = out
        return cache[key]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_conversion_logits_equal_hf_folder(arch, tiny_checkpoint, converted):
    hf = aligned(Engine.from_pretrained(tiny_checkpoint(arch)))
    ftw = Engine.from_pretrained(converted(arch, "fp32"))
    ids = _prompt(20, seed=1)
    assert torch.equal(_prefill(ftw, ids), _prefill(hf, ids))
    with hf.new_session() as a, ftw.new_session() as b:
        a.prefill(ids[:10])
        b.prefill(ids[:10])
        for t in ids[10:]:
            assert torch.equal(b.decode(t), a.decode(t))
    # The embedded tokenizer and config behave like the folder's.
    assert ftw.tokenizer.encode("def add(a, b):") == hf.tokenizer.encode("def add(a, b):")
    assert ftw.tokenizer.chat_template == hf.tokenizer.chat_template
    assert ftw.default_stop_token_ids() == hf.default_stop_token_ids()
    assert ftw.hf_config.to_dict() | {"_name_or_path": ""} == hf.hf_config.to_dict() | {"_name_or_path": ""}


def test_compressed_fp32_conversion_is_exact_too(tiny_checkpoint, converted):
    hf = aligned(Engine.from_pretrained(tiny_checkpoint("qwen2_moe")))
    path = converted("qwen2_moe", "fp32", compress=True)
    with FTWFile(path) as f:
        assert {f.expert_info(*k).compression for k in f.expert_keys()} == {"zstd"}
    ids = _prompt(12, seed=2)
    assert torch.equal(_prefill(Engine.from_pretrained(path), ids), _prefill(hf, ids))


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_storage_equals_hf_folder_at_bf16(arch, tiny_checkpoint, converted):
    """Default policy: dense bf16 (engine fp32-only params in fp32), experts and biases bf16. Loaded at
    bf16 that is bit-exact with the fp32 folder loaded at bf16 (both round fp32 -> bf16 once, RNE)."""
    path = converted(arch, "bf16")
    hf = aligned(Engine.from_pretrained(tiny_checkpoint(arch), dtype=torch.bfloat16))
    ftw = Engine.from_pretrained(path, dtype=torch.bfloat16)
    ids = _prompt(16, seed=3)
    assert torch.equal(_prefill(ftw, ids), _prefill(hf, ids))
    with hf.new_session() as a, ftw.new_session() as b:
        a.prefill(ids[:8])
        b.prefill(ids[:8])
        for t in ids[8:]:
            assert torch.equal(b.decode(t), a.decode(t))
    keep_fp32 = ftw.model.fp32_parameter_names()
    with FTWFile(path) as f:
        dtypes = {n: f.dense_info(n).dtype for n in f.dense_names()}
        codecs = {t.codec for k in f.expert_keys() for t in f.expert_info(*k).tensors.values()}
    assert codecs == {"bf16"}
    assert all(dt == ("float32" if n in keep_fp32 else "bfloat16") for n, dt in dtypes.items())
    assert (arch == "deepseek_v3") == bool(keep_fp32)


@pytest.fixture(scope="module")
def codec_error(tiny_checkpoint, converted):
    """`codec_error(arch, quant)` -> median relative logit error vs the fp32 folder (cached)."""
    cache: dict[tuple[str, str], float] = {}
    ids = [_prompt(32, seed=0), _prompt(32, seed=1)]

    def get(arch: str, quant: str) -> float:
        if (arch, "ref") not in cache:
            ref = Engine.from_pretrained(tiny_checkpoint(arch))
            cache[(arch, "ref")] = torch.cat([_prefill(ref, x) for x in ids])  # type: ignore[assignment]
        if (arch, quant) not in cache:
            lossy = Engine.from_pretrained(converted(arch, quant))
            got = torch.cat([_prefill(lossy, x) for x in ids])
            cache[(arch, quant)] = _median_rel_err(got, cache[(arch, "ref")])  # type: ignore[arg-type]
        return cache[(arch, quant)]

    return get


@pytest.mark.parametrize("quant", ["int8", "fp8", "mxfp4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_lossy_codec_error_within_stated_bound(arch, quant, codec_error, converted):
    err = codec_error(arch, quant)
    print(f"{arch} {quant}: median relative logit error {err:.2e}")
    assert 0 < err < CODEC_BOUNDS[quant]
    if quant != "mxfp4":  # 4-bit is the coarsest codec on every tiny model
        assert err < codec_error(arch, "mxfp4")
    with FTWFile(converted(arch, quant)) as f:
        codecs = {t.codec for k in f.expert_keys() for t in f.expert_info(*k).tensors.values()}
    assert codecs - {"bf16"} == {"fp8_e4m3" if quant == "fp8" else quant}  # biases (gpt-oss) in bf16


@pytest.mark.parametrize("arch", ARCHS)
def test_only_the_routed_experts_are_read(arch, converted):
    path = converted(arch, "bf16")
    engine = Engine.from_pretrained(path)
    provider = engine.experts
    assert isinstance(provider, FTWExpertProvider)
    ftw = provider.ftw
    assert ftw.bytes_read == 0 and provider.experts_loaded == 0  # opening reads no expert bytes
    counter = RoutingCounter(provider)
    engine.use_expert_provider(counter)
    _prefill(engine, _prompt(2, seed=4))
    routed = sorted(counter.selected)
    want = sum(ftw.expert_info(*k).block_length for k in routed)
    total = sum(ftw.expert_info(*k).block_length for k in ftw.expert_keys())
    assert ftw.bytes_read == provider.bytes_read == want < total
    assert provider.loaded_keys() == routed and provider.experts_loaded == len(routed)
    _prefill(engine, _prompt(2, seed=4))  # the same experts again: served from memory
    assert ftw.bytes_read == want
    # A decode step reads only the blocks of newly routed experts.
    with engine.new_session() as s:
        s.decode(7)
    new = set(counter.selected) - set(routed)
    assert ftw.bytes_read == want + sum(ftw.expert_info(*k).block_length for k in new)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_auto_policy_stores_hot_experts_in_the_hot_codec(arch, converted):
    path = converted(arch, "auto")
    with FTWFile(path) as f:
        auto = f.metadata["auto"]
        counts = {int(k): v for k, v in auto["routing_counts"].items()}
        hot = {int(k): v for k, v in auto["hot_experts"].items()}
        top_k = f.model_config["num_experts_per_tok"]
        assert auto["policy"]["hot_fraction"] == 0.25 and auto["calibration_tokens"] > 0
        for layer, c in counts.items():
            assert sum(c) == auto["calibration_tokens"] * top_k  # every selection counted
            assert len(hot[layer]) == 2  # ceil(25% of 8)
            assert min(c[e] for e in hot[layer]) >= max(c[e] for e in range(8) if e not in hot[layer])
        for layer, e in f.expert_keys():
            codecs = {n: t.codec for n, t in f.expert_info(layer, e).tensors.items()}
            want = "bf16" if e in hot[layer] else "mxfp4"
            assert codecs["gate_up"] == codecs["down"] == want
    engine = Engine.from_pretrained(path)
    logits = _prefill(engine, _prompt(8, seed=5))
    assert torch.isfinite(logits).all()


def test_auto_policy_is_configurable(tiny_checkpoint, tmp_path):
    out = tmp_path / "m.ftw"
    policy = AutoPolicy(hot_fraction=0.5, hot_codec="int8", cold_codec="fp8_e4m3", prompts=("hello",))
    report = convert_checkpoint(
        tiny_checkpoint("mixtral"),
        out,
        quant="auto",
        auto_policy=policy,
        progress=False,
        open_model=Engine.for_calibration,
    )
    assert report.hot_experts is not None and all(len(v) == 4 for v in report.hot_experts.values())
    assert report.codec_counts == {"int8": 24, "fp8_e4m3": 24}
    with FTWFile(out) as f:
        assert f.metadata["auto"]["policy"]["cold_codec"] == "fp8_e4m3"


def test_report_and_embedded_files(tiny_checkpoint, converted):
    path = converted("deepseek_v3", "mxfp4")
    with FTWFile(path) as f:
        assert f.metadata["quant"] == "mxfp4" and f.metadata["dense_dtype"] == "bfloat16"
        assert set(f.tokenizer_files) == {
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "generation_config.json",
        }
        assert f.model_config["model_type"] == "deepseek_v3"
        assert "lm_head.weight" in f.dense_names() and "layers.1.mlp.router.weight" in f.dense_names()
        assert f.dense_info("layers.1.mlp.router.weight").dtype == "float32"  # kept fp32, as the engine
    report = convert_checkpoint(tiny_checkpoint("deepseek_v3"), path.with_suffix(".2.ftw"), quant="mxfp4")
    assert report.codec_counts == {"mxfp4": 32} and report.expert_blocks == 16
    assert 0 < report.expert_bytes < report.file_bytes and report.ratio < 0.5
    assert "mxfp4 x32" in report.summary()


# ---- bad input ------------------------------------------------------------------------------


def test_missing_ftw_file_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "nope.ftw")


def test_foreign_and_truncated_files(tmp_path, converted):
    foreign = tmp_path / "model.ftw"
    foreign.write_bytes(b"GGUF" + bytes(8000))
    with pytest.raises(FTWFormatError, match="not an FTW file"):
        Engine.from_pretrained(foreign)
    truncated = tmp_path / "cut.ftw"
    data = converted("mixtral", "bf16").read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(FTWFormatError, match="cut.ftw"):
        Engine.from_pretrained(truncated)


def test_corrupted_expert_block_fails_when_read(tmp_path, converted):
    path = shutil.copy(converted("mixtral", "bf16"), tmp_path / "bad.ftw")
    with FTWFile(path) as f:
        info = f.expert_info(1, 3)
    raw = bytearray(Path(path).read_bytes())
    raw[info.data_offset + 100] ^= 0xFF
    Path(path).write_bytes(bytes(raw))
    engine = Engine.from_pretrained(path)  # the block is not read yet
    with pytest.raises(FTWFormatError, match=r"expert block \(layer=1, expert=3\).*offset"):
        engine.experts.get(1, 3)


def test_corrupted_dense_tensor_fails_at_open(tmp_path, converted):
    path = shutil.copy(converted("mixtral", "bf16"), tmp_path / "bad.ftw")
    with FTWFile(path) as f:
        d = f.dense_info("layers.0.self_attn.q_proj.weight")
    raw = bytearray(Path(path).read_bytes())
    raw[d.offset + 10] ^= 0x01
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(FTWFormatError, match="q_proj.weight.*checksum"):
        Engine.from_pretrained(path)


def _rewrite(src: Path, dst: Path, *, drop=(), extra=None) -> Path:
    """Copy an FTW file with some expert blocks dropped or added (a well-formed but wrong file)."""
    with (
        FTWFile(src) as f,
        FTWWriter(dst, model_config=f.model_config, tokenizer_files=f.tokenizer_files) as w,
    ):
        for name in f.dense_names():
            w.add_dense(name, f.dense(name))
        for key in f.expert_keys():
            if key not in drop:
                w.add_expert(*key, f.encoded_expert(*key))
        if extra is not None:
            w.add_expert(*extra, f.encoded_expert(0, 0))
    return dst


def test_expert_index_out_of_range_or_missing(tmp_path, converted):
    src = converted("mixtral", "bf16")
    with pytest.raises(FTWFormatError, match=r"layer=0, expert=8\).*out of range"):
        Engine.from_pretrained(_rewrite(src, tmp_path / "extra.ftw", extra=(0, 8)))
    with pytest.raises(FTWFormatError, match=r"no expert block \(layer=2, expert=5\)"):
        Engine.from_pretrained(_rewrite(src, tmp_path / "missing.ftw", drop={(2, 5)}))


def test_bad_arguments(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="unknown quant"):
        convert_checkpoint(tiny_checkpoint("mixtral"), tmp_path / "m.ftw", quant="q3_k")
    with pytest.raises(CheckpointError, match="does not exist"):
        convert_checkpoint(tmp_path / "no-such-folder", tmp_path / "m.ftw")
    assert not (tmp_path / "m.ftw").exists()


def test_mxfp4_falls_back_to_bf16_where_it_cannot_represent_a_weight(tmp_path, caplog):
    folder = build_tiny_model("mixtral", tmp_path / "m", intermediate_size=48)  # down [64, 48]
    report = convert_checkpoint(folder, tmp_path / "m.ftw", quant="mxfp4", progress=False)
    assert report.fallbacks == 24 and report.codec_counts == {"mxfp4": 24, "bf16": 24}
    assert "storing it as bf16" in caplog.text
    ref = Engine.from_pretrained(folder)
    err = _median_rel_err(
        _prefill(Engine.from_pretrained(tmp_path / "m.ftw"), _prompt(16, 0)), _prefill(ref, _prompt(16, 0))
    )
    assert err < CODEC_BOUNDS["mxfp4"]
