"""Observability of the tiered expert memory: time per phase (each part reports its own `stats()`;
`TieredExpertProvider.stats` composes them).

Phases (seconds, summed since construction, compute thread only):
- attention: the attention modules' forward (forward hooks the provider installs on the modules it is given);
- experts: expert matmuls (tier 1 or host);
- wait_storage: demand reads from tier 3 the compute thread waited for;
- wait_prefetch: waiting for a prefetch load (queued or running) of an expert this layer uses;
- decode: tier 2 -> tier 1 (CPU: decode, or the zero-copy move; CUDA: not timed on the host);
- predict: pre-gating (the next layer's router on this layer's hidden state).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch


class PhaseTimer:
    """Seconds and counts per named phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: Counter[str] = Counter()

    def time(self, name: str) -> _Phase:
        """Time the body as phase `name`; `as` gives a function returning its seconds once it
        ended. (A class, not a generator context manager: ~1 us less per use, a few uses per layer
        of a decode step.)"""
        return _Phase(self, name)

    def add(self, name: str, seconds: float, runs: int = 1) -> None:
        """Count `runs` runs of phase `name` that took `seconds` together."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] += runs

    def stats(self) -> dict[str, dict[str, Any]]:
        """`phase_s` (seconds per phase) and `phase_calls` (times each ran)."""
        return {"phase_s": dict(self.seconds), "phase_calls": dict(self.counts)}

    def hook(self, module: torch.nn.Module, name: str) -> list[Any]:
        """Time every forward of `module` as phase `name`; returns the hook handles."""
        started: list[float] = []

        def pre(_mod: torch.nn.Module, _args: Any) -> None:
            started.append(time.perf_counter())

        def post(_mod: torch.nn.Module, _args: Any, _out: Any) -> None:
            if started:
                self.add(name, time.perf_counter() - started.pop())

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


class _Phase:
    """One timed use of `PhaseTimer.time`."""

    __slots__ = ("timer", "name", "t0", "seconds")

    def __init__(self, timer: PhaseTimer, name: str) -> None:
        self.timer, self.name, self.seconds = timer, name, 0.0

    def __enter__(self) -> Callable[[], float]:
        self.t0 = time.perf_counter()
        return self.took

    def took(self) -> float:
        return self.seconds

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.timer.add(self.name, self.seconds)
