"""Byte budgets for the engine's memory tiers."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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
