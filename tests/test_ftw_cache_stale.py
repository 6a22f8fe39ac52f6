"""The conversion cache never serves stale experts: expert bytes changed with size, safetensors
header and mtime kept (cp -p, rsync -t, a restored backup) rebuild the entry and change the
model fingerprint; an unchanged folder is reused; an entry without a source record is rebuilt."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch

import freetoken_agents.engine.loading.cache as cache
from freetoken_agents.engine import Engine, MemoryBudget
from freetoken_agents.engine.loading.cache import cache_root

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 17, 5, 9, 1, 12, 30, 8, 2, 21, 4, 15]


def greedy(engine: Engine) -> list[int]:
    return engine.generate(PROMPT, max_new_tokens=12, stop_token_ids=()).token_ids


@pytest.fixture
def folder(tiny_checkpoint, tmp_path):
    dst = tmp_path / "mixtral"
    shutil.copytree(tiny_checkpoint("mixtral"), dst)
    return dst


@pytest.fixture
def conversions(monkeypatch):
    count = {"n": 0}
    real = cache.convert_checkpoint

    def counting(*args, **kwargs):
        count["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(cache, "convert_checkpoint", counting)
    return count


def budget_for(folder) -> MemoryBudget:
    with Engine.from_pretrained(folder) as resident:
        expert_bytes = resident.describe()["expert_bytes"]
    return MemoryBudget(fast_bytes=expert_bytes // 4, host_bytes=expert_bytes)


def load(folder, budget, cache_dir) -> tuple[list[int], str]:
    with Engine.from_pretrained(folder, memory=budget, cache_dir=cache_dir, progress=False) as engine:
        return greedy(engine), engine.model_fingerprint


def rewrite_experts_keeping_size_header_mtime(folder) -> None:
    """Scale every expert tensor's bytes in place (same size, same header), then restore mtime."""
    (path,) = sorted(folder.glob("*.safetensors"))
    st = path.stat()
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    data = bytearray(path.read_bytes())
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__" or "experts" not in name or info["dtype"] != "F32":
            continue
        start, end = info["data_offsets"]
        t = torch.frombuffer(data[base + start : base + end], dtype=torch.float32).clone()
        data[base + start : base + end] = (t * -3.0).numpy().tobytes()
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_changed_expert_bytes_with_kept_size_header_mtime_rebuild(folder, tmp_path, conversions):
    budget = budget_for(folder)
    cache_dir = tmp_path / "cache"
    old_tokens, old_fp = load(folder, budget, cache_dir)
    assert conversions["n"] == 1
    (entry,) = cache_root(cache_dir).glob("*.ftw")

    rewrite_experts_keeping_size_header_mtime(folder)
    assert list(cache_root(cache_dir).glob("*.ftw")) == [entry]  # the old key still names the entry
    new_tokens, new_fp = load(folder, budget, cache_dir)
    assert conversions["n"] == 2  # rebuilt, not served stale
    with Engine.from_pretrained(folder) as fresh:
        assert new_tokens == greedy(fresh)
    assert new_fp != old_fp


def test_an_unchanged_folder_is_not_rebuilt(folder, tmp_path, conversions):
    budget = budget_for(folder)
    cache_dir = tmp_path / "cache"
    first = load(folder, budget, cache_dir)
    second = load(folder, budget, cache_dir)
    assert conversions["n"] == 1 and first == second


def test_same_bytes_with_new_metadata_are_rehashed_not_rebuilt(folder, tmp_path, conversions):
    budget = budget_for(folder)
    cache_dir = tmp_path / "cache"
    first = load(folder, budget, cache_dir)
    (path,) = sorted(folder.glob("*.safetensors"))
    os.utime(path)  # a touch: mtime and ctime move, content does not
    assert load(folder, budget, cache_dir) == first
    assert conversions["n"] == 1  # rehashed, found equal, record refreshed
    assert load(folder, budget, cache_dir) == first
    assert conversions["n"] == 1


def test_an_old_entry_without_a_source_record_is_rebuilt(folder, tmp_path, conversions):
    budget = budget_for(folder)
    cache_dir = tmp_path / "cache"
    load(folder, budget, cache_dir)
    (record,) = cache_root(cache_dir).glob("*.ftw.source")
    record.unlink()  # what an entry from before source records looks like
    rewrite_experts_keeping_size_header_mtime(folder)
    tokens, _ = load(folder, budget, cache_dir)
    assert conversions["n"] == 2
    with Engine.from_pretrained(folder) as fresh:
        assert tokens == greedy(fresh)


def test_the_fingerprint_covers_the_ftw_file_actually_served(folder, tmp_path, monkeypatch):
    """Same HF folder, different served experts (as a stale cache would be): different fingerprints."""
    import freetoken_agents.engine.loading.assemble as assemble
    from freetoken_agents.engine.loading.convert import convert_checkpoint

    budget = budget_for(folder)
    honest_tokens, honest_fp = load(folder, budget, tmp_path / "cache")
    other = tmp_path / "other" / folder.name
    shutil.copytree(folder, other)
    rewrite_experts_keeping_size_header_mtime(other)
    stale = tmp_path / "stale.ftw"
    convert_checkpoint(other, stale, quant="fp32", progress=False)
    monkeypatch.setattr(assemble, "cached_ftw", lambda *a, **k: stale)
    stale_tokens, stale_fp = load(folder, budget, tmp_path / "unused")
    assert stale_tokens != honest_tokens  # the served experts really differ
    assert stale_fp != honest_fp
