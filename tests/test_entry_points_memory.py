"""Every entry point takes the engine options and passes them down unchanged: FreeTokenModel,
ChatFreeToken and the CLI (chat, generate, demo, recipe; `python -m` recipes) with a memory
budget run the tiered q* engine and answer exactly as the all-resident engine does."""

from __future__ import annotations

import argparse
import io
import re
import sys

import pytest

from freetoken_agents import FreeTokenModel, GenerateRequest, default_model
from freetoken_agents.cli import main
from freetoken_agents.engine import Engine, EngineError, MemoryBudget
from freetoken_agents.engine.flags import add_engine_arguments, engine_options
from freetoken_agents.integrations.langchain import ChatFreeToken, clear_engines
from freetoken_agents.recipes import tool_loop

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Conversions go to a temporary cache, never the user's."""
    monkeypatch.setenv("FREETOKEN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def embedded_expert_bytes() -> int:
    return Engine.from_pretrained(default_model()).describe()["expert_bytes"]


def quarter(expert_bytes: int) -> MemoryBudget:
    return MemoryBudget(fast_bytes=expert_bytes // 4, host_bytes=expert_bytes)


def assert_tiered(engine: Engine, budget: MemoryBudget) -> None:
    stats = engine.stats()
    assert stats["placement"] == "qstar"
    assert stats["tiers"]["fast"]["used_bytes"] <= budget.fast_bytes
    assert stats["tiers"]["fast"]["misses"] > 0


def reply(model: FreeTokenModel, text: str) -> str:
    model.reset()
    model.sync(model.render([{"role": "user", "content": text}], None))
    events = model.generate(GenerateRequest(max_new_tokens=16))
    return "".join(e.text for e in events if e.kind == "text")


def test_free_token_model_passes_the_memory_budget_to_its_engine(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    resident = FreeTokenModel.from_pretrained(path)
    budget = quarter(resident.engine.describe()["expert_bytes"])
    tiered = FreeTokenModel.from_pretrained(path, memory=budget)
    assert reply(tiered, "Hello there") == reply(resident, "Hello there")
    assert_tiered(tiered.engine, budget)
    tiered.engine.close()


def test_chat_free_token_takes_a_memory_budget_or_its_fields(tiny_checkpoint):
    clear_engines()
    path = str(tiny_checkpoint("qwen3_moe"))
    resident = ChatFreeToken(model=path, max_tokens=12)
    budget = quarter(resident.engine.describe()["expert_bytes"])
    tiered = ChatFreeToken(model=path, max_tokens=12, memory=budget)
    assert tiered.invoke("Hello there").content == resident.invoke("Hello there").content
    assert tiered.engine is not resident.engine
    assert_tiered(tiered.engine, budget)
    as_dict = ChatFreeToken(model=path, max_tokens=12, memory=budget.model_dump())
    assert as_dict.engine is tiered.engine  # the same options share one engine
    as_text = ChatFreeToken(model=path, memory={"fast_bytes": str(budget.fast_bytes), "host_bytes": "1GiB"})
    assert as_text.engine_options().memory.host_bytes == 2**30  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="placement"):  # pydantic checks the fields at construction
        ChatFreeToken(model=path, placement="everywhere")  # type: ignore[arg-type]
    with pytest.raises(EngineError, match="device: must be"):
        ChatFreeToken(model=path, device="npu").invoke("hi")
    clear_engines()


# ---- the CLI ----------------------------------------------------------------------------------
def memory_flags(expert_bytes: int) -> list[str]:
    return ["--fast-mem", str(expert_bytes // 4), "--host-mem", str(expert_bytes)]


def test_generate_with_memory_flags_prints_the_resident_engines_text(embedded_expert_bytes, capsys):
    args = ["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "8"]
    assert main(args) == 0
    resident = capsys.readouterr().out
    assert main([*args, *memory_flags(embedded_expert_bytes), "--placement", "qstar"]) == 0
    assert capsys.readouterr().out == resident


def test_expert_quant_reaches_the_engine_from_the_cli_and_langchain(embedded_expert_bytes, capsys):
    """`--expert-quant int8`: the tiered engine holds its experts in int8 and prints what the
    resident int8 engine prints; ChatFreeToken(expert_quant=...) loads its engine with it."""
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_options(parser.parse_args(["--expert-quant", "int8"])).expert_quant == "int8"
    assert engine_options(parser.parse_args([])).expert_quant == "auto"
    args = ["generate", "--prompt", "def add(a, b):", "--max-new-tokens", "8", "--expert-quant", "int8"]
    assert main(args) == 0
    resident = capsys.readouterr().out
    assert main([*args, *memory_flags(embedded_expert_bytes), "--placement", "qstar"]) == 0
    assert capsys.readouterr().out == resident
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses a bad choice (exit 2, usage)
        main(["generate", "--prompt", "hi", "--expert-quant", "int4"])
    assert exit_info.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
    clear_engines()
    chat = ChatFreeToken(
        model=str(default_model()), max_tokens=4, expert_quant="int8", memory=quarter(embedded_expert_bytes)
    )
    assert chat.engine.describe()["expert_quant"] == "int8"
    chat.invoke("Hello there")
    tp = chat.engine.experts
    assert all(tp.fast.peek(k).is_quantized for k in tp.fast.keys())  # type: ignore[attr-defined]
    clear_engines()


def test_chat_stats_shows_the_tiers(embedded_expert_bytes, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2 plus 3?\n/stats\n/quit\n"))
    assert main(["chat", "--max-new-tokens", "6", *memory_flags(embedded_expert_bytes)]) == 0
    out = capsys.readouterr().out
    assert "placement: qstar (a fast and host memory budget was given)" in out
    assert "  fast: " in out and "  host: " in out and "q* decisions:" in out and "KV cache:" in out


def without_anchor_ids(text: str) -> str:
    """An anchor's id covers the expert-cache state it pins, which differs between placements;
    a tool's wall time ("(0.05 s)") differs between runs on a busy machine."""
    text = re.sub(r"\(\d+\.\d+ s\)", "(<t> s)", text)
    return re.sub(r"anchor [0-9a-f]{8}", "anchor <id>", text)


def test_recipe_and_demo_take_the_engine_flags(embedded_expert_bytes, capsys):
    assert main(["recipe", "tool_loop"]) == 0
    resident = without_anchor_ids(capsys.readouterr().out)
    assert "anchor <id>: system_prompt" in resident
    assert main(["recipe", "tool_loop", *memory_flags(embedded_expert_bytes)]) == 0
    assert without_anchor_ids(capsys.readouterr().out) == resident
    assert tool_loop.main(memory_flags(embedded_expert_bytes)) == 0  # python -m ...recipes.tool_loop
    assert without_anchor_ids(capsys.readouterr().out) == resident
    assert main(["demo", "--tasks", "1", *memory_flags(embedded_expert_bytes)]) == 0
    assert "demo summary:" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "text"),
    [
        (["--fast-mem", "8 gigs"], "--fast-mem: cannot read '8 gigs' as a size"),
        (["--fast-mem", "10KiB"], "(give --fast-mem "),
        (["--host-mem", "-1"], "--host-mem: cannot read '-1' as a size"),
        (["--device", "npu"], "device: must be 'cpu' or 'cuda[:N]'"),
    ],
)
def test_bad_engine_flags_are_one_line_errors(flags, text, capsys):
    assert main(["generate", "--prompt", "hi", *flags]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("freetoken generate: error: ") and "\n" not in err
    assert text in err
    assert tool_loop.main(flags) == 1  # the recipe as a program says the same
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m freetoken_agents.recipes.tool_loop: error: ") and text in err
