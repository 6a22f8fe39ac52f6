"""`freetoken convert` (issue 65): it refuses, in one line and before any work, a checkpoint folder
that `freetoken generate` could not use (no tokenizer files), and its summary's codec counts add
up to the total they are labelled with."""

from __future__ import annotations

import re
import shutil

import pytest

from freetoken_agents.cli import main
from freetoken_agents.engine.text.tokenizer_files import TOKENIZER_FILES


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("quant", ["bf16", "auto"])
def test_convert_refuses_a_folder_without_tokenizer_files(tiny_checkpoint, tmp_path, capsys, quant):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_checkpoint("olmoe"), folder, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    assert (folder / "config.json").is_file() and not (folder / "tokenizer.json").exists()
    capsys.readouterr()  # building the tiny model writes to stderr
    out = tmp_path / "m.ftw"
    assert main(["convert", str(folder), str(out), "--quant", quant]) == 1
    line = one_error_line(capsys)
    assert line.startswith("freetoken convert: error:") and "no tokenizer files" in line
    assert "tokenizer.json" in line and "freetoken generate" in line
    assert not out.exists()  # refused before any work: no file, no calibration


def test_convert_with_a_tokenizer_is_not_refused(tiny_checkpoint, tmp_path, capsys):
    source, out = tiny_checkpoint("olmoe"), tmp_path / "m.ftw"
    capsys.readouterr()
    assert main(["convert", str(source), str(out), "--quant", "bf16"]) == 0
    assert out.is_file() and capsys.readouterr().err == ""


def test_a_folder_that_is_no_checkpoint_gets_the_converters_own_error(tmp_path, capsys):
    folder = tmp_path / "empty"
    folder.mkdir()
    assert main(["convert", str(folder), str(tmp_path / "m.ftw")]) == 1
    assert "config.json" in one_error_line(capsys)


SUMMARY = re.compile(r"(\d+) expert blocks \((\d+) weight projections: ([^)]*)\)")


@pytest.mark.parametrize(
    "arch, argv, blocks, codecs",
    [
        ("olmoe", ["--quant", "mxfp4"], 24, {"mxfp4": 48}),
        ("mixtral", ["--quant", "auto"], 24, {"bf16": 12, "mxfp4": 36}),  # 2 hot experts of 8
    ],
)
def test_the_summary_counts_add_up_to_their_total(
    tiny_checkpoint, tmp_path, capsys, arch, argv, blocks, codecs
):
    out = tmp_path / f"{arch}.ftw"
    assert main(["convert", str(tiny_checkpoint(arch)), str(out), *argv]) == 0
    line = capsys.readouterr().out.strip()
    match = SUMMARY.search(line)
    assert match, line
    counted = {c: int(n) for c, n in re.findall(r"(\w+) x(\d+)", match.group(3))}
    assert int(match.group(1)) == blocks and counted == codecs
    assert sum(counted.values()) == int(match.group(2)) == 2 * blocks  # gate_up and down per block
