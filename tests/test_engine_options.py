"""One engine, built in one place: `Engine.from_pretrained(..., memory=, placement=)` tiers the
experts (q*) for an HF folder (through the conversion cache) and an FTW file, with greedy tokens
identical to the all-resident engine; "auto" placement; the cache's reuse and repair; bad options
as named one-line errors; loading robustness (a broken tokenizer, gpt-oss configs without the
SwiGLU constants)."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from tiny_models import tiny_config

import freetoken_agents.engine.loading.assemble as assemble
from freetoken_agents.engine import Engine, EngineError, MemoryBudget, MemoryBudgetError
from freetoken_agents.engine.adapters import adapter_for
from freetoken_agents.engine.ftw import FTWFile
from freetoken_agents.engine.loading.cache import cache_root
from freetoken_agents.engine.loading.convert import convert_checkpoint
from freetoken_agents.engine.loading.placement import resolve_placement

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 17, 5, 9, 1, 12, 30, 8, 2, 21, 4, 15]


@pytest.fixture(scope="module")
def sources(tiny_checkpoint, tmp_path_factory):
    """The tiny Mixtral as an HF folder and as an FTW file (fp32, so both are the same weights)."""
    folder = tiny_checkpoint("mixtral")
    ftw = tmp_path_factory.mktemp("ftw") / "mixtral.ftw"
    convert_checkpoint(folder, ftw, quant="fp32", progress=False)
    return {"hf": folder, "ftw": ftw}


def greedy(engine: Engine, n: int = 12) -> list[int]:
    return engine.generate(PROMPT, max_new_tokens=n, stop_token_ids=()).token_ids


def quarter_budget(expert_bytes: int) -> MemoryBudget:
    """The issue's budget: fast memory for a quarter of the experts, host RAM for all of them."""
    return MemoryBudget(fast_bytes=expert_bytes // 4, host_bytes=expert_bytes)


def assert_tiered(engine: Engine, budget: MemoryBudget) -> None:
    stats = engine.stats()
    assert stats["placement"] == "qstar"
    assert stats["tiers"]["fast"]["used_bytes"] <= budget.fast_bytes
    assert stats["tiers"]["fast"]["misses"] > 0


@pytest.mark.parametrize("source", ["hf", "ftw"])
def test_a_memory_budget_tiers_the_experts_with_identical_greedy_tokens(source, sources, tmp_path):
    resident = Engine.from_pretrained(sources[source])
    assert resident.stats()["placement"] == "resident"
    budget = quarter_budget(resident.describe()["expert_bytes"])
    with Engine.from_pretrained(sources[source], memory=budget, cache_dir=tmp_path) as tiered:
        assert greedy(tiered) == greedy(resident)
        assert_tiered(tiered, budget)
        assert "budget was given" in tiered.stats()["placement_reason"]
    converted = list(cache_root(tmp_path).glob("*.ftw"))
    assert len(converted) == (1 if source == "hf" else 0)  # an FTW file is used in place


def test_auto_tiers_experts_that_do_not_fit_free_memory(sources, tmp_path, monkeypatch):
    resident = Engine.from_pretrained(sources["ftw"])
    experts = resident.describe()["expert_bytes"]
    monkeypatch.setattr(assemble, "free_fast_bytes", lambda _device: experts)  # 90% of it is too little
    with Engine.from_pretrained(sources["ftw"]) as engine:
        stats = engine.stats()
        assert stats["placement"] == "qstar" and "do not fit" in stats["placement_reason"]
        assert engine.memory.fast_bytes == int(0.3 * experts)  # the default share of what is free
        assert greedy(engine) == greedy(resident)


def test_resolve_placement_makes_auto_concrete():
    budget = MemoryBudget(host_bytes=10)
    assert resolve_placement("auto", None, 100, 1000).placement == "resident"
    assert resolve_placement("auto", None, 950, 1000).placement == "qstar"
    assert resolve_placement("auto", budget, 100, 1000).placement == "qstar"
    assert resolve_placement("stream", None, 100, 1000).placement == "stream"
    with pytest.raises(MemoryBudgetError, match="placement 'resident'") as info:
        resolve_placement("resident", MemoryBudget(fast_bytes=50), 100, 1000)
    assert info.value.option == "fast_bytes" and info.value.minimum_bytes == 100


# ---- the conversion cache ---------------------------------------------------------------------
def test_the_converted_checkpoint_is_reused_and_a_damaged_one_rebuilt(sources, tmp_path, caplog):
    folder = sources["hf"]
    resident = Engine.from_pretrained(folder)
    want = greedy(resident)
    budget = quarter_budget(resident.describe()["expert_bytes"])

    def load() -> list[int]:
        with Engine.from_pretrained(folder, memory=budget, cache_dir=tmp_path, progress=False) as engine:
            return greedy(engine)

    assert load() == want
    (entry,) = cache_root(tmp_path).glob("*.ftw")
    made = entry.stat()
    caplog.set_level(logging.INFO, logger="freetoken_agents.engine.loading.cache")
    assert load() == want
    assert "using the cached conversion" in caplog.text
    assert (entry.stat().st_ino, entry.stat().st_mtime_ns) == (made.st_ino, made.st_mtime_ns)

    with FTWFile(entry) as f:  # flip bytes inside one expert block
        offset = f.expert_info(0, 3).data_offset + 11
    with open(entry, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    caplog.clear()
    assert load() == want
    assert "is damaged" in caplog.text and "checksum" in caplog.text
    with FTWFile(entry) as f:
        f.verify()  # rebuilt whole

    with open(entry, "r+b") as f:  # a partial entry: cut short
        f.truncate(entry.stat().st_size // 2)
    caplog.clear()
    assert load() == want
    assert "is damaged" in caplog.text
    with FTWFile(entry) as f:
        f.verify()


# ---- bad options: named one-line errors -------------------------------------------------------
def test_a_fast_budget_below_one_layers_working_set_names_the_smallest_that_works(sources):
    with pytest.raises(MemoryBudgetError, match="raise MemoryBudget.fast_bytes to at least") as info:
        Engine.from_pretrained(sources["ftw"], memory=MemoryBudget(fast_bytes=1000))
    smallest = info.value.minimum_bytes
    assert info.value.option == "fast_bytes" and smallest > 1000 and "\n" not in str(info.value)
    Engine.from_pretrained(sources["ftw"], memory=MemoryBudget(fast_bytes=smallest)).close()


@pytest.mark.parametrize(
    ("options", "error", "text"),
    [
        ({"device": "tpu"}, EngineError, "device: must be 'cpu' or 'cuda[:N]'"),
        ({"placement": "fast"}, EngineError, "placement"),
        ({"dtype": "int4"}, EngineError, "dtype: must be one of"),
        ({"memory": {"fast_bytes": "lots"}}, MemoryBudgetError, "cannot read 'lots' as a size"),
        ({"memory": {"fast_bytes": 1}, "placement": "resident"}, MemoryBudgetError, "placement 'resident'"),
        ({"expert_quant": "int4", "placement": "qstar"}, EngineError, "unknown expert_quant 'int4'"),
    ],
)
def test_bad_engine_options_are_named_one_line_errors(sources, options, error, text):
    with pytest.raises(error) as info:
        Engine.from_pretrained(sources["ftw"], **options)
    assert text in str(info.value) and "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_is_an_engine_error(sources):
    with pytest.raises(EngineError, match="CUDA is not available"):
        Engine.from_pretrained(sources["ftw"], device="cuda")


def test_memory_sizes_may_be_strings_and_fractions():
    assert MemoryBudget(fast_bytes="8GiB").fast_bytes == 8 * 2**30
    budget = MemoryBudget.from_strings("0.25", "1GiB", free_host=lambda: 4 * 2**30)
    assert budget is not None and (budget.fast_bytes, budget.host_bytes) == (2**30, 2**30)
    assert MemoryBudget.from_strings(None, None) is None
    with pytest.raises(MemoryBudgetError, match="--host-mem: cannot read '2 gigs'"):
        MemoryBudget.from_strings(None, "2 gigs", names=("--fast-mem", "--host-mem"))


# ---- loading robustness -----------------------------------------------------------------------
def test_a_checkpoint_whose_tokenizer_cannot_load_still_runs_on_token_ids(tiny_checkpoint, tmp_path, caplog):
    folder = tmp_path / "broken-tokenizer"
    shutil.copytree(tiny_checkpoint("qwen3_moe"), folder)
    (folder / "tokenizer.json").write_text("{this is not json")
    with caplog.at_level(logging.WARNING):
        engine = Engine.from_pretrained(folder)
    assert "token-id use only" in caplog.text
    reference = Engine.from_pretrained(tiny_checkpoint("qwen3_moe"))
    assert greedy(engine, 4) == greedy(reference, 4)
    with pytest.raises(EngineError, match="cannot be loaded .*token ids only"):
        engine.apply_chat_template([{"role": "user", "content": "hi"}])


def test_gpt_oss_configs_without_swiglu_constants_use_the_architectures():
    config = tiny_config("gpt_oss")
    for name in ("swiglu_limit", "swiglu_alpha"):
        if hasattr(config, name):
            delattr(config, name)
    spec = adapter_for("gpt_oss").build_spec(config)
    moe = spec.layers[0].moe
    assert moe is not None and (moe.swiglu_limit, moe.swiglu_alpha) == (7.0, 1.702)


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:", " cpu"])
def test_check_device_refuses_a_malformed_device_with_an_engine_error(device: str) -> None:
    from freetoken_agents.engine import check_device

    with pytest.raises(EngineError, match=r"device must be 'cpu' or 'cuda\[:N\]'"):
        check_device(device)  # was: torch's RuntimeError for 'tpu' and 'cuda:x'
    assert check_device("cpu") == torch.device("cpu")
