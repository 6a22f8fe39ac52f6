"""Byte budgets for the engine's memory tiers, given in bytes or as fractions of free memory."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)


def free_host_bytes() -> int:
    """Available host RAM in bytes (psutil's `available`; /proc/meminfo MemAvailable without it)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil is installed here
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError as e:
        raise RuntimeError(f"cannot read free host memory: {e}") from e
    raise RuntimeError("cannot read free host memory: no psutil and no MemAvailable in /proc/meminfo")


def free_cuda_bytes(device: str | torch.device = "cuda") -> int:
    """Free memory of a CUDA device in bytes (`torch.cuda.mem_get_info`)."""
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


class MemoryBudget(BaseModel):
    """How much memory the engine may use.

    `fast_bytes`: tier 1 (GPU VRAM, or the resident decoded set in RAM on a CPU-only machine),
    shared by KV blocks and resident experts. `host_bytes`: tier 2 (host RAM for stored expert
    blocks). `kv_bytes`: an upper bound for the paged KV cache alone. None means unbounded.
    """

    model_config = ConfigDict(frozen=True)

    fast_bytes: int | None = Field(default=None, gt=0)
    host_bytes: int | None = Field(default=None, gt=0)
    kv_bytes: int | None = Field(default=None, gt=0)

    @classmethod
    def from_fractions(
        cls,
        fast: float | None = None,
        host: float | None = None,
        *,
        device: str | torch.device = "cpu",
        kv_bytes: int | None = None,
        free_host: Callable[[], int] = free_host_bytes,
        free_device: Callable[[torch.device], int] = free_cuda_bytes,
    ) -> MemoryBudget:
        """A budget from fractions (0 < f <= 1) of the memory free *now*; None leaves a tier unbounded.

        On a CUDA `device`, `fast` is a fraction of that device's free memory and `host` of free
        host RAM. On the CPU both tiers live in host RAM, so both fractions are of the same free
        RAM and must sum to at most 1. `free_host` / `free_device` are injectable (tests).
        Raises ValueError for a fraction outside (0, 1] or CPU fractions summing above 1.
        """
        for name, f in (("fast", fast), ("host", host)):
            if f is not None and not 0.0 < f <= 1.0:
                raise ValueError(f"MemoryBudget.from_fractions: {name}={f} must be in (0, 1]")
        dev = torch.device(device)
        ram = free_host() if host is not None or (fast is not None and dev.type != "cuda") else 0
        if dev.type == "cuda":
            fast_pool = free_device(dev) if fast is not None else 0
        else:
            if (fast or 0.0) + (host or 0.0) > 1.0:
                raise ValueError(
                    f"MemoryBudget.from_fractions: on the CPU fast ({fast}) and host ({host}) share "
                    "the same free RAM and must sum to at most 1"
                )
            fast_pool = ram
        budget = cls(
            fast_bytes=max(1, int(fast * fast_pool)) if fast is not None else None,
            host_bytes=max(1, int(host * ram)) if host is not None else None,
            kv_bytes=kv_bytes,
        )
        logger.info("memory budget from fractions fast=%s host=%s on %s: %s", fast, host, dev, budget)
        return budget
