"""Weights cannot change under a running engine: an FTW file changed or truncated after loading is
detected (FTWFormatError) on the next read, never a silent change of the model's output or a SIGBUS."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from freetoken_agents.engine import Engine, FTWFormatError
from freetoken_agents.engine.ftw import FTWFile
from freetoken_agents.engine.loading.convert import convert_checkpoint

IDS = [5, 17, 3, 250, 41, 9, 77, 120]


@pytest.fixture(scope="module")
def fp32_ftw(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny qwen3_moe model as an fp32 FTW file (its dense tensors stored in fp32)."""
    out = tmp_path_factory.mktemp("ftw") / "model.ftw"
    hf = tiny_checkpoint("qwen3_moe")
    convert_checkpoint(hf, out, quant="fp32", dense_dtype=torch.float32, progress=False)
    return out


def _copy(src: Path, folder: Path) -> Path:
    dst = folder / "model.ftw"
    shutil.copyfile(src, dst)
    return dst


def _logits(engine: Engine) -> torch.Tensor:
    with engine.new_session() as s:
        return s.prefill(IDS)


def _overwrite_dense(path: Path) -> list[str]:
    """Write new bytes over every dense tensor of `path`, in place (same inode). Returns the names."""
    with FTWFile(path) as f:
        spans = [(name, f.dense_info(name).offset, f.dense_info(name).nbytes) for name in f.dense_names()]
    with path.open("r+b") as out:
        for _, offset, nbytes in spans:
            out.seek(offset)
            out.write(bytes((i * 37 + 11) % 251 for i in range(nbytes)))
    return [name for name, _, nbytes in spans if nbytes]


def test_fp32_dense_weights_do_not_change_when_the_file_does(fp32_ftw, tmp_path):
    path = _copy(fp32_ftw, tmp_path)
    engine = Engine.from_pretrained(path)  # fp32 file, fp32 engine: nothing to convert
    before = _logits(engine)
    names = _overwrite_dense(path)
    assert torch.equal(_logits(engine), before)  # the engine's dense weights are its own
    with FTWFile(path) as f, pytest.raises(FTWFormatError, match=f"dense tensor '{names[0]}': checksum"):
        f.dense(names[0], verify=True)
    engine.close()


_TRUNCATE = """
import os, sys
from freetoken_agents.engine import Engine, FTWFormatError
engine = Engine.from_pretrained(sys.argv[1])
os.truncate(sys.argv[1], 4096)
try:
    with engine.new_session() as s:
        s.prefill([5, 17, 3, 250])
except FTWFormatError as e:
    print("FTWFormatError:", e)
"""


def test_truncated_file_under_a_running_engine_gives_ftw_format_error_not_sigbus(fp32_ftw, tmp_path):
    path = _copy(fp32_ftw, tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", _TRUNCATE, str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert done.returncode != -signal.SIGBUS, "SIGBUS: the engine still reads the file through a mapping"
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"FTWFormatError: {path}") and "file truncated" in done.stdout


def test_changed_expert_block_under_a_running_engine_gives_ftw_format_error(fp32_ftw, tmp_path):
    path = _copy(fp32_ftw, tmp_path)
    engine = Engine.from_pretrained(path)
    with FTWFile(path) as f:
        infos = [f.expert_info(*key) for key in f.expert_keys()]
    with path.open("r+b") as out:  # one byte of every block, so whichever runs first is caught
        for info in infos:
            out.seek(info.data_offset + info.stored_length // 2)
            byte = out.read(1)
            out.seek(-1, os.SEEK_CUR)
            out.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(FTWFormatError, match="checksum mismatch"):
        _logits(engine)
    engine.close()
