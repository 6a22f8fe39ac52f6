"""A process-wide cache of loaded engines, keyed by model path (or Hub id) and load options.

LangChain constructs chat models often (per request, per agent step, thousands of times in its
standard test suite), so `ChatFreeToken(...)` must not load weights. The first generation calls
`shared_engine(...)`, which loads once per (path, engine options, tool format) and hands every later
caller the same `EngineHandle`: the engine, the backend whose contexts the calls open (one per
call, `new_context()`), and the prefix cache they share. Every step runs on the engine's one step
worker (`sync_bridge.step_worker`), the executor the Agent and the server use too.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from freetoken_agents.engine import Engine, EngineOptions, is_hub_id
from freetoken_agents.sync_bridge import step_worker

from ..prefix_cache import PrefixCache
from .backend import LangChainBackend

logger = logging.getLogger(__name__)


@dataclass
class EngineHandle:
    """One loaded model as the adapter shares it.

    engine: the `freetoken_agents.engine.Engine`.
    backend: the FreeTokenModel subclass each call opens its context from (`new_context()`).
    cache: the content-addressed prefix cache over the engine's anchors, shared by the calls.
    worker: the engine's step worker, which runs every step of every call.
    """

    engine: Any
    backend: LangChainBackend
    cache: PrefixCache
    worker: concurrent.futures.ThreadPoolExecutor = field(init=False)
    _idle: list[LangChainBackend] = field(default_factory=list, init=False)
    _idle_lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self.worker = step_worker(self.backend.step_owner)

    def open_context(self) -> LangChainBackend:
        """A context for one call: the one the last finished call gave back, when no other call
        holds it (its session still holds that call's prompt and reply, so the conversation's
        next call keeps them as they are), else a new one (`new_context()`)."""
        with self._idle_lock:
            if self._idle:
                return self._idle.pop()
        return self.backend.new_context()

    def release_context(self, context: LangChainBackend, *, keep: bool = True) -> None:
        """The call is done with `context`: kept for the next call (at most `MAX_IDLE_CONTEXTS`
        are), else closed (its KV back to the pool; the prefix cache's anchors keep their own)."""
        with self._idle_lock:
            if keep and len(self._idle) < MAX_IDLE_CONTEXTS:
                self._idle.append(context)
                return
        context.close()


MAX_IDLE_CONTEXTS = 1  # what one idle context costs: the KV of its last prompt and reply
_HANDLES: dict[tuple, EngineHandle] = {}
_LOAD_LOCK = threading.Lock()


def engine_key(path: str | Path, options: EngineOptions, family: str | None = None) -> tuple:
    """The cache key: resolved path (a Hugging Face Hub id, `org/name[@revision]`, as spelled: the
    engine fetches it), the engine options (everything that changes what gets loaded) and the
    tool-call family the backend parses."""
    resolved = str(path) if is_hub_id(path) else str(Path(path).expanduser().resolve())
    return (resolved, options.key(), family)


def shared_engine(
    path: str | Path,
    options: EngineOptions | None = None,
    *,
    family: str | None = None,
    max_anchors: int = 32,
) -> EngineHandle:
    """The shared handle for `path` (an HF checkpoint folder, an .ftw file or a Hub id) loaded with
    `options` (`freetoken_agents.engine.EngineOptions`: device, dtype, memory, placement...,
    passed to `Engine.from_options` unchanged), loading on first use.

    Raises whatever `Engine.from_pretrained` raises (CheckpointError, FTWFormatError,
    MemoryBudgetError, EngineError...).
    """
    options = options or EngineOptions()
    key = engine_key(path, options, family)
    handle = _HANDLES.get(key)
    if handle is not None:
        return handle
    with _LOAD_LOCK:
        handle = _HANDLES.get(key)
        if handle is None:
            engine = Engine.from_options(key[0], options)
            backend = LangChainBackend(engine, family=family)
            handle = EngineHandle(engine, backend, PrefixCache(max_entries=max_anchors))
            _HANDLES[key] = handle
            logger.info("loaded engine for %s (%s)", key[0], engine.stats()["placement"])
    return handle


def clear_engines() -> None:
    """Forget every cached engine (tests; frees memory once no model object holds one)."""
    with _LOAD_LOCK:
        _HANDLES.clear()
