"""Byte budgets for the engine's memory tiers, given in bytes or as fractions of free memory."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Annotated, Any

import torch
from pydantic import BaseModel, BeforeValidator, ByteSize, ConfigDict, Field, TypeAdapter, ValidationError

from ..errors import MemoryBudgetError

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


_BYTES = TypeAdapter(ByteSize)
_FRACTION = re.compile(r"^\s*(0?\.\d+|0|1(\.0*)?)\s*$")


def parse_size(value: str | int, option: str = "size") -> int:
    """Bytes from an int or a size string ("8GiB", "512 MB", "1.5GB", "4096"); units are
    pydantic's `ByteSize` ones (KB = 1000, KiB = 1024). MemoryBudgetError naming `option` when
    it cannot be read."""
    if isinstance(value, bool):
        raise MemoryBudgetError(f"{option}: expected a size in bytes, got {value!r}", option=option)
    try:
        return int(_BYTES.validate_python(value))
    except ValidationError:
        raise MemoryBudgetError(
            f"{option}: cannot read {value!r} as a size (e.g. 8GiB, 512MB, 1073741824)", option=option
        ) from None


def format_size(nbytes: int) -> str:
    """`nbytes` for people: '12.0MiB', '3.5GiB' (binary units, rounded up so it is enough)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{-(-nbytes * 10 // scale) / 10:.1f}{unit}"
    return f"{nbytes}B"


def _size_field(value: Any) -> Any:
    return parse_size(value, "memory budget") if isinstance(value, str) else value


SizeBytes = Annotated[Annotated[int, Field(gt=0)] | None, BeforeValidator(_size_field)]
"""A byte count > 0 (or None), also given as a size string such as "8GiB"."""


class MemoryBudget(BaseModel):
    """How much memory the engine may use.

    `fast_bytes`: tier 1 (GPU VRAM, or the resident decoded set in RAM on a CPU-only machine),
    shared by KV blocks and resident experts. `host_bytes`: tier 2 (host RAM for stored expert
    blocks). `kv_bytes`: an upper bound for the paged KV cache alone. None means unbounded.
    """

    model_config = ConfigDict(frozen=True)

    fast_bytes: SizeBytes = None
    host_bytes: SizeBytes = None
    kv_bytes: SizeBytes = None

    @classmethod
    def from_strings(
        cls,
        fast: str | None = None,
        host: str | None = None,
        *,
        device: str | torch.device = "cpu",
        kv_bytes: int | None = None,
        names: tuple[str, str] = ("fast", "host"),
        free_host: Callable[[], int] = free_host_bytes,
        free_device: Callable[[torch.device], int] = free_cuda_bytes,
    ) -> MemoryBudget | None:
        """A budget from what a user typed (the CLI's --fast-mem / --host-mem): each a size
        ("8GiB", "512MB") or a fraction of the memory free now ("0.25": a plain number in (0, 1]);
        None leaves that tier to the engine's default. Returns None when both are None.
        MemoryBudgetError naming the option (`names`) for a value that is neither."""
        if fast is None and host is None:
            return None
        sizes: dict[str, int | None] = {}
        fractions: dict[str, float | None] = {"fast": None, "host": None}
        for tier, text, name in (("fast", fast, names[0]), ("host", host, names[1])):
            if text is None:
                continue
            if _FRACTION.match(str(text)):
                fraction = float(text)
                if fraction <= 0:
                    raise MemoryBudgetError(f"{name}: must be above 0, got {text!r}", option=f"{tier}_bytes")
                fractions[tier] = fraction
            else:
                sizes[f"{tier}_bytes"] = parse_size(text, name)
        if any(f is not None for f in fractions.values()):
            base = cls.from_fractions(
                fractions["fast"],
                fractions["host"],
                device=device,
                free_host=free_host,
                free_device=free_device,
            )
            sizes = {"fast_bytes": base.fast_bytes, "host_bytes": base.host_bytes} | sizes
        return cls(**sizes, kv_bytes=kv_bytes)

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
