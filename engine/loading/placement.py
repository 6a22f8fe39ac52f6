"""Where a model's experts go: the sizes that decide it, `resolve_placement` ("auto" made
concrete, with the reason) and the default budgets of a tiered engine.

Pure functions of the spec, the options and the free memory (which the caller measures and tests
inject), so the decision is testable without a machine of any particular size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..errors import EngineError, MemoryBudgetError
from ..memory import MemoryBudget
from ..memory.budget import format_size, free_cuda_bytes, free_host_bytes
from ..options import DEVICE_PATTERN
from ..spec import ModelSpec

logger = logging.getLogger(__name__)

FIT_FRACTION = 0.9
""""auto" keeps experts resident only when they take at most this share of the free memory."""
DEFAULT_FAST_FRACTION = {"cpu": 0.3, "cuda": 0.85}
"""Tier 1's default share of the free memory (CPU: RAM, shared with tier 2; CUDA: VRAM)."""
DEFAULT_HOST_FRACTION = {"cpu": 0.5, "cuda": 0.7}
"""Tier 2's default share of the free host RAM."""


@dataclass(frozen=True)
class PlacementChoice:
    """What `resolve_placement` chose ("resident", "qstar" or "stream") and why."""

    placement: str
    reason: str


def expert_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    """Bytes of every routed expert decoded to `dtype` (what the resident engine holds)."""
    elem = torch.empty((), dtype=dtype).element_size()
    total = 0
    for layer in spec.moe_layers():
        moe = spec.layers[layer].moe
        assert moe is not None
        h, i = spec.hidden_size, moe.intermediate_size
        per_expert = 3 * i * h + ((2 * i + h) if moe.expert_bias else 0)
        total += moe.num_experts * per_expert * elem
    return total


"""The devices an engine runs on: "cpu", "cuda" or "cuda:N"."""


def check_device(device: str) -> torch.device:
    """The torch device for `device` ("cpu", "cuda", "cuda:N"); EngineError if it is malformed
    or not on this machine."""
    if not DEVICE_PATTERN.match(device):
        raise EngineError(f"device must be 'cpu' or 'cuda[:N]', got '{device}'")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EngineError(f"device '{device}' requested but CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise EngineError(f"device '{device}' does not exist: this machine has {count} CUDA device(s)")
    return dev


def free_fast_bytes(device: torch.device) -> int:
    """Free memory where tier 1 lives: the CUDA device's, or available RAM."""
    return free_cuda_bytes(device) if device.type == "cuda" else free_host_bytes()


def resolve_placement(
    requested: str, memory: MemoryBudget | None, experts: int, free_fast: int
) -> PlacementChoice:
    """Make "auto" concrete (see `options`); check a "resident" request against its budget.

    `experts`: bytes of all experts in the compute dtype; `free_fast`: free bytes where tier 1
    lives, measured after the dense weights were loaded. MemoryBudgetError when placement
    "resident" is asked with a fast budget smaller than the experts.
    """
    fast = memory.fast_bytes if memory is not None else None
    host = memory.host_bytes if memory is not None else None
    if requested == "resident":
        if fast is not None and fast < experts:
            raise MemoryBudgetError(
                f"placement 'resident' keeps every expert in fast memory ({format_size(experts)}) but "
                f"fast_bytes is {format_size(fast)}; raise fast_bytes to at least {format_size(experts)} "
                "or use placement 'auto' or 'qstar'",
                option="fast_bytes",
                minimum_bytes=experts,
            )
        return PlacementChoice("resident", "requested")
    if requested in ("qstar", "stream"):
        return PlacementChoice(requested, "requested")
    if fast is not None or host is not None:
        given = " and ".join(n for n, v in (("fast", fast), ("host", host)) if v is not None)
        return PlacementChoice("qstar", f"a {given} memory budget was given")
    if experts > FIT_FRACTION * free_fast:
        return PlacementChoice(
            "qstar", f"the experts ({format_size(experts)}) do not fit free memory ({format_size(free_fast)})"
        )
    return PlacementChoice(
        "resident", f"the experts ({format_size(experts)}) fit free memory ({format_size(free_fast)})"
    )


def tiered_budget(
    memory: MemoryBudget | None, device: torch.device, free_fast: int, free_host: int
) -> MemoryBudget:
    """The budget a tiered engine runs under: what was given, with a missing fast or host budget
    set to its default share of the memory free now (`DEFAULT_FAST_FRACTION`,
    `DEFAULT_HOST_FRACTION`), so a model bigger than memory never grows past it."""
    memory = memory or MemoryBudget()
    kind = "cuda" if device.type == "cuda" else "cpu"
    fast = memory.fast_bytes
    host = memory.host_bytes
    if fast is None:
        fast = max(1, int(DEFAULT_FAST_FRACTION[kind] * free_fast))
    if host is None:
        host = max(1, int(DEFAULT_HOST_FRACTION[kind] * free_host))
    budget = MemoryBudget(fast_bytes=fast, host_bytes=host, kv_bytes=memory.kv_bytes)
    if budget != memory:
        logger.info("tiered expert memory budget (defaults filled in from free memory): %s", budget)
    return budget
