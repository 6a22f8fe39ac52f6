"""recipes/tiny/soup.py: two FTW files of one model averaged weight by weight, checked against the
average of their weights as transformers loads them; files that are not the same model refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken_agents import default_model
from freetoken_agents.engine.ftw.reader import FTWFile
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.recipes.tiny.soup import SoupError, main, soup
from freetoken_agents.recipes.tiny.warm import load_ftw

pytestmark = pytest.mark.usefixtures("one_thread")


def _perturbed(out: Path, scale: float = 0.05, seed: int = 0) -> Path:
    """The embedded model with noise on every weight: another model of the same shape and tokenizer."""
    model, tokenizer = load_ftw(default_model())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.add_(torch.randn(tensor.shape, generator=generator) * scale)
    model.save_pretrained(out / "hf")
    tokenizer.save_pretrained(out / "hf")
    with FTWFile(default_model()) as ftw:
        metadata = {"trained_tools": ftw.metadata["trained_tools"]}
    convert_checkpoint(out / "hf", out / "model.ftw", quant="bf16", progress=False, extra_metadata=metadata)
    return out / "model.ftw"


def test_a_soup_is_the_weighted_average_of_the_two_models(tmp_path: Path) -> None:
    other = _perturbed(tmp_path / "other")
    out = soup(default_model(), other, 0.25, tmp_path / "soup")
    mixed, _ = load_ftw(out)
    a, _ = load_ftw(default_model())
    b, _ = load_ftw(other)
    sa, sb = a.state_dict(), b.state_dict()
    for name, tensor in mixed.state_dict().items():
        want = 0.25 * sa[name] + 0.75 * sb[name]  # stored in bf16: within a rounding of it
        torch.testing.assert_close(tensor, want, rtol=2**-7, atol=2**-20, msg=name)
    with FTWFile(out) as ftw, FTWFile(default_model()) as shipped:
        assert ftw.metadata["trained_tools"] == shipped.metadata["trained_tools"]
        assert ftw.tokenizer_files == shipped.tokenizer_files
    assert (tmp_path / "soup" / "hf" / "config.json").is_file()


def test_files_that_are_not_one_model_or_a_weight_outside_0_1_are_refused(tmp_path: Path, capsys) -> None:
    with pytest.raises(SoupError, match=r"^--weight must be between 0 and 1, got 1.5$"):
        soup(default_model(), default_model(), 1.5, tmp_path / "x")
    model, tokenizer = load_ftw(default_model())
    model.config.num_hidden_layers = 2
    model.model.layers = model.model.layers[:2]
    model.save_pretrained(tmp_path / "small" / "hf")
    tokenizer.save_pretrained(tmp_path / "small" / "hf")
    small = tmp_path / "small" / "model.ftw"
    convert_checkpoint(tmp_path / "small" / "hf", small, quant="bf16", progress=False)
    with pytest.raises(SoupError, match=r"are different models \(config differs in num_hidden_layers\)$"):
        soup(default_model(), small, 0.5, tmp_path / "y")
    capsys.readouterr()
    assert main([str(default_model()), str(small), "--weight", "0.5", "--out", str(tmp_path / "z")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "y").exists() and not (tmp_path / "z").exists()


def test_a_file_that_is_missing_or_not_ftw_is_one_line_not_a_traceback(tmp_path: Path, capsys) -> None:
    """A file that is not FTW (or is not there) raised FTWFormatError from deep inside the reader."""
    garbage = tmp_path / "garbage.ftw"
    garbage.write_bytes(b"not an FTW file")
    for path in (garbage, tmp_path / "missing.ftw"):
        capsys.readouterr()
        assert main([str(path), str(default_model()), "--weight", "0.5", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
