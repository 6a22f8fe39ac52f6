"""Shared fixtures: tiny random checkpoints of every supported architecture, built once per run;
a `freetoken serve` server with the default config and an `openai` client of it, per module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import build_tiny_model


@pytest.fixture(scope="session", autouse=True)
def private_user_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Conversions, fingerprints and anchor keys go to temporary dirs, never the user's cache or
    config (tests that need a specific place set their own)."""
    keep = {name: os.environ.get(name) for name in ("FREETOKEN_CACHE", "FREETOKEN_CONFIG_DIR")}
    os.environ["FREETOKEN_CACHE"] = str(tmp_path_factory.mktemp("freetoken-cache"))
    os.environ["FREETOKEN_CONFIG_DIR"] = str(tmp_path_factory.mktemp("freetoken-config"))
    yield
    for name, value in keep.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """`tiny_checkpoint(arch)` -> folder of a saved tiny model (cached per arch for the session)."""
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return get


@pytest.fixture
def anchor_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh anchor key file for the test (created by the first save): the anchor tests' own.
    Use with `pytestmark = pytest.mark.usefixtures("anchor_key")` where every test saves."""
    path = tmp_path / "keys" / "anchor.key"
    monkeypatch.setenv("FREETOKEN_ANCHOR_KEY_FILE", str(path))
    return path


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """The tiny models' ops are too small to split: one thread avoids OpenMP contention.
    Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def kernel_calls(monkeypatch) -> list[tuple[int, ...]]:
    """Weight shapes of the calls of the fused int8 kernel (torch._weight_int8pack_mm) made
    during the test (its one-time self-check runs before counting starts)."""
    from freetoken_agents.engine.kernels.int8 import kernel_available

    kernel_available()
    calls: list[tuple[int, ...]] = []
    real = torch._weight_int8pack_mm

    def counting(x, q, scales):
        calls.append(tuple(q.shape))
        return real(x, q, scales)

    monkeypatch.setattr(torch, "_weight_int8pack_mm", counting)
    return calls


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    """A real server over the embedded model with the default config (`serve_harness`), one per
    test module; a module that needs another config defines its own `server`."""
    from serve_harness import running_server

    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    """An `openai.OpenAI` client of the module's `server`."""
    return server.client()
