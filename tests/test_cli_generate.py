"""`freetoken generate` streams text; errors are one line and a non-zero exit code."""

from __future__ import annotations

from freetoken_agents.cli import main
from freetoken_agents.engine import Engine


def test_generate_streams_greedy_text(tiny_checkpoint, capsys):
    path = tiny_checkpoint("qwen3_moe")
    assert main(["generate", str(path), "--prompt", "def add(a, b):", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    engine = Engine.from_pretrained(path)
    ids = engine.tokenizer.encode("def add(a, b):", add_special_tokens=False)
    expected = engine.generate(ids, max_new_tokens=6)
    assert out == expected.text + "\n"


def test_generate_missing_model_is_one_line_error(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("freetoken generate: error:") and "\n" not in err
    assert "does not exist" in err
