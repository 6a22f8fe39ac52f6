"""`freetoken convert` and `freetoken inspect [--verify]` end to end (through `cli.main`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken_agents.cli import main
from freetoken_agents.engine.ftw import FTWFile


@pytest.fixture(scope="module")
def ftw_file(tiny_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "olmoe.ftw"
    assert main(["convert", str(tiny_checkpoint("olmoe")), str(out), "--quant", "mxfp4"]) == 0
    return out


def test_convert_prints_a_one_line_summary(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "m.ftw"
    rc = main(["convert", str(tiny_checkpoint("mixtral")), str(out), "--quant", "auto", "--compress"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    assert str(out) in lines[0] and "bytes" in lines[0] and "of 1,0" in lines[0]
    assert "bf16 x12" in lines[0] and "mxfp4 x36" in lines[0]  # 2 hot experts of 8, 3 layers
    with FTWFile(out) as f:
        assert {f.expert_info(*k).compression for k in f.expert_keys()} == {"zstd"}


def test_inspect_prints_header_codecs_and_layers(ftw_file, capsys):
    assert main(["inspect", str(ftw_file)]) == 0
    out = capsys.readouterr().out
    assert "FTW 1.0, alignment 4096" in out
    assert "model: olmoe, 3 layers" in out
    assert "codecs: weights mxfp4 x48; biases none" in out
    assert "tokenizer.json" in out and "dense: 30 tensors" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[:2] for r in rows] == [["0", "8"], ["1", "8"], ["2", "8"]]
    assert "verify" not in out


def test_inspect_verify_ok(ftw_file, capsys):
    assert main(["inspect", str(ftw_file), "--verify"]) == 0
    assert "verify: OK (30 dense tensors, 24 expert blocks)" in capsys.readouterr().out


def test_inspect_verify_names_the_corrupted_block(ftw_file, tmp_path, capsys):
    with FTWFile(ftw_file) as f:
        info = f.expert_info(2, 6)
    data = bytearray(ftw_file.read_bytes())
    data[info.data_offset + 7] ^= 0x40
    bad = tmp_path / "bad.ftw"
    bad.write_bytes(bytes(data))
    assert main(["inspect", str(bad)]) == 0  # header and manifest are intact
    capsys.readouterr()
    assert main(["inspect", str(bad), "--verify"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("freetoken inspect: error:")
    assert "expert block (layer=2, expert=6)" in err[0] and f"offset {info.data_offset}" in err[0]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["inspect", "{tmp}/missing.ftw"], "cannot open FTW file"),
        (["inspect", "{tmp}/foreign.ftw"], "not an FTW file"),
        (["convert", "{tmp}/no-folder", "{tmp}/x.ftw"], "does not exist"),
        (["convert", "{tmp}/no-folder", "{tmp}/x.ftw", "--device", "tpu"], "device"),
    ],
)
def test_errors_are_one_line_with_nonzero_exit(argv, match, tmp_path, capsys):
    (tmp_path / "foreign.ftw").write_bytes(b"PK\x03\x04" + bytes(5000))
    assert main([a.format(tmp=tmp_path) for a in argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_convert_quant_auto_calibrates_on_the_gpu_and_streams_there(tiny_checkpoint, tmp_path, capsys):
    """`freetoken convert --quant auto --device cuda` end to end: routing measured by the model on
    the GPU, hot experts bf16 and cold ones MXFP4, and the tiered CUDA engine (compact blocks
    decoded on the GPU) gives the logits of a CPU engine on the same file."""
    from freetoken_agents.engine import Engine
    from freetoken_agents.engine.ftw import FTWFile
    from freetoken_agents.engine.memory import MemoryBudget

    folder = tiny_checkpoint("qwen3_moe")
    out = tmp_path / "auto.ftw"
    assert (
        main(["convert", str(folder), str(out), "--quant", "auto", "--device", "cuda", "--no-progress"]) == 0
    )
    with FTWFile(out) as f:
        codecs = {t.codec for k in f.expert_keys() for t in f.expert_info(*k).tensors.values()}
        assert f.metadata["auto"]["calibration_tokens"] > 0
    assert codecs == {"bf16", "mxfp4"}
    cpu = Engine.from_pretrained(
        out, device="cpu", dtype=torch.float32, placement="resident", expert_quant="none"
    )
    gpu = Engine.from_pretrained(
        out, device="cuda", dtype=torch.float32, placement="qstar", memory=MemoryBudget()
    )
    gpu.experts.fast.resize(gpu.experts.min_working_set * 2)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    torch.testing.assert_close(
        gpu.new_session().prefill(ids).cpu(), cpu.new_session().prefill(ids), rtol=1e-4, atol=1e-4
    )
    assert gpu.stats()["bytes_moved"]["host->fast"] > 0
    gpu.close()
