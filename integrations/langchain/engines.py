"""A process-wide cache of loaded engines, keyed by model path and load options.

LangChain constructs chat models often (per request, per agent step, thousands of times in its
standard test suite), so `ChatFreeToken(...)` must not load weights. The first generation calls
`shared_engine(...)`, which loads once per (path, dtype, device, memory) and hands every later
caller the same `EngineHandle`: the engine, the one backend session over it, its prefix cache
and the lock that serialises work on them (engine sessions are not thread-safe).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .backend import LangChainBackend
from .prefix_cache import PrefixCache

logger = logging.getLogger(__name__)


@dataclass
class EngineHandle:
    """One loaded model as the adapter shares it.

    engine: the `freetoken_agents.engine.Engine`.
    backend: the FreeTokenModel subclass whose session is the kept (live) context.
    cache: the content-addressed prefix cache over that session's anchors.
    lock: held for the whole of one generation (sync, prefill, decode).
    """

    engine: Any
    backend: LangChainBackend
    cache: PrefixCache
    lock: threading.Lock = field(default_factory=threading.Lock)


_HANDLES: dict[tuple, EngineHandle] = {}
_LOAD_LOCK = threading.Lock()


def engine_key(path: str | Path, dtype: str, device: str, memory: dict[str, Any] | None) -> tuple:
    """The cache key: resolved path plus the options that change what gets loaded."""
    resolved = str(Path(path).expanduser().resolve())
    return (resolved, dtype, device, tuple(sorted((memory or {}).items())))


def shared_engine(
    path: str | Path,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    memory: dict[str, Any] | None = None,
    family: str | None = None,
    max_anchors: int = 32,
) -> EngineHandle:
    """The shared handle for `path` (an HF checkpoint folder or an .ftw file), loading on first use.

    `dtype` is a torch dtype name ("float32", "bfloat16"); `memory` holds `MemoryBudget` fields.
    Raises whatever `Engine.from_pretrained` raises (CheckpointError, FTWFormatError, ...).
    """
    key = engine_key(path, dtype, device, memory)
    handle = _HANDLES.get(key)
    if handle is not None:
        return handle
    with _LOAD_LOCK:
        handle = _HANDLES.get(key)
        if handle is None:
            import torch

            from freetoken_agents.engine import Engine
            from freetoken_agents.engine.memory import MemoryBudget

            budget = MemoryBudget(**memory) if memory else None
            engine = Engine.from_pretrained(key[0], dtype=getattr(torch, dtype), device=device, memory=budget)
            backend = LangChainBackend(engine, family=family)
            handle = EngineHandle(engine, backend, PrefixCache(max_entries=max_anchors))
            _HANDLES[key] = handle
            logger.info("loaded engine for %s (%s, %s)", key[0], dtype, device)
    return handle


def clear_engines() -> None:
    """Forget every cached engine (tests; frees memory once no model object holds one)."""
    with _LOAD_LOCK:
        _HANDLES.clear()
