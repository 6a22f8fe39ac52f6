"""`freetoken chat` keeps going after a line too long for the model's context (an error line with
the true token count), and sampling options with bad values are one argparse error line naming
the option (not a pydantic dump from inside the run)."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from freetoken_agents.cli import main
from freetoken_agents.embedded import default_model
from freetoken_agents.engine import Engine


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SYSTEM = "You are a helpful assistant."


def test_an_over_long_line_is_refused_and_the_chat_goes_on(monkeypatch, capsys) -> None:
    engine = Engine.from_pretrained(default_model())
    long_line = "hello " * engine.max_context  # longer than the context whatever the model's is
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{long_line}\nHi\n/anchors\n/quit\n"))
    assert main(["chat", "--max-new-tokens", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": long_line.strip()}]
    tokens = len(engine.apply_chat_template(messages))
    assert tokens > engine.max_context
    assert (
        f"[message not sent: with it the conversation is {tokens} tokens and the model's context is " in out
    )
    assert out.count("assistant> ") == 1  # "Hi" was answered
    assert "system_prompt at token" in out  # the history was left as it was: its anchor is still there


def test_a_reply_stops_at_the_end_of_the_context(monkeypatch, capsys) -> None:
    """A message that fits with little room: the reply ends where the context does, no error."""
    engine = Engine.from_pretrained(default_model())
    words = 1
    while True:  # the longest message that still leaves a little room
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "hello " * (words + 1)},
        ]
        if len(engine.apply_chat_template(messages)) + 8 > engine.max_context:
            break
        words += 1
    script = f"{'hello ' * words}\nHi\n/quit\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    args = ["chat", "--max-new-tokens", "64", "--temperature", "1.5", "--seed", "3", "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> ") >= 1 and "exceed" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["chat", "--max-new-tokens", "-1"], "argument --max-new-tokens: must be at least 1, got -1"),
        (["chat", "--temperature", "-0.5"], "argument --temperature: must be 0 or more, got -0.5"),
        (
            ["generate", "--prompt", "x", "--max-new-tokens", "-1"],
            "argument --max-new-tokens: must be at least 1",
        ),
        (["generate", "--prompt", "x", "--top-p", "2"], "argument --top-p: must be in (0, 1], got 2"),
        (["generate", "--prompt", "x", "--top-k", "0"], "argument --top-k: must be at least 1, got 0"),
        (
            ["demo", "--max-new-tokens", "many"],
            "argument --max-new-tokens: invalid positive_int value: 'many'",
        ),
        (["chat", "--temperature", "hot"], "argument --temperature: expected a number, got 'hot'"),
    ],
)
def test_bad_sampling_options_are_one_error_line(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"freetoken {argv[0]}: error: {message}" or err[-1].startswith(
        f"freetoken {argv[0]}: error: {message}"
    )
    assert not any("validation error" in line or "pydantic" in line for line in err)
