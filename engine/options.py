"""What a user chooses when loading a model: one typed record that every entry point (Engine,
FreeTokenModel, ChatFreeToken, the CLI, the server) passes down unchanged to the composition root
(`assemble.assemble`), so what a user sets is what runs.

Placements (`Placement`):
- ``"auto"`` (default): tiered q* when a fast or host budget is given, or when the experts do not
  fit the device's free memory (CUDA: `torch.cuda.mem_get_info`; CPU: available RAM); resident
  otherwise. The choice and its reason are logged and reported by `engine.stats()["placement"]`.
- ``"resident"``: every expert in fast memory (RAM on a CPU-only machine, VRAM on CUDA).
- ``"qstar"``: the three-tier expert memory under the q* policy (`memory.TieredExpertProvider`).
- ``"stream"``: the per-layer-LRU streaming baseline (mixtral-offloading's design), for benchmarks.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .choices import Placement
from .errors import EngineError
from .kernels.int8 import DenseQuantPart, ExpertQuant, check_dense_quant, check_expert_quant
from .memory import ROUTING_DECAY, MemoryBudget

DEVICE_PATTERN = re.compile(r"^(cpu|cuda(:\d+)?)$")
"""What `device` may name: "cpu", "cuda" or "cuda:N"."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
"""dtype names the options accept (besides a torch.dtype)."""


@dataclass(frozen=True)
class TieringOptions:
    """Tuning of the tiered expert memory (`TieredExpertProvider`'s keyword arguments); the
    defaults are what users get. Tests and benchmarks change them (`prefetch_thread=False` loads
    inline, deterministically; `clock` and `policy` are injectable). `expert_slots`: tier 1 keeps
    its experts in one slot pool, computed by grouped GEMMs (float) or grouped GEMVs (int8, MXFP4
    kept compact) and capturable in a CUDA graph
    (None: on a GPU with placement "qstar"; on a CPU the experts that move up zero-copy and the
    per-expert loop are faster, so there only when asked for). `fill_at_load`: without a routing
    profile, fill tier 1's free room at load with an even share of every layer's experts
    (`TieredExpertProvider.fill_fast`; False: tier 1 starts empty and fills by demand)."""

    prefetch: bool = True
    prefetch_thread: bool = True
    prefetch_depth: int = 3
    hot_every: int = 16
    decay: float = ROUTING_DECAY
    max_pinned_fraction: float = 0.5
    direct_io: bool = True
    policy: Any = None
    clock: Callable[[], float] = time.monotonic
    expert_slots: bool | None = None
    fill_at_load: bool = True

    def provider_kwargs(self) -> dict[str, Any]:
        """The fields the provider's constructor takes (`fill_at_load` is the loader's)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "fill_at_load"}


class EngineOptions(BaseModel):
    """How to load a model. Every field has the default a new user should get.

    device: "cpu" or "cuda[:N]". dtype: compute dtype (a torch.dtype or a name such as
    "float32", "bfloat16"). memory: byte budgets (`MemoryBudget`, or a dict of its fields; sizes
    may be strings such as "8GiB"). placement: see the module docstring. expert_quant /
    dense_quant: int8 weight-only compute (`int8.py`). quant: the FTW codec an HF folder is
    converted to when it must be tiered (None: lossless, the values the resident engine holds).
    cache_dir: where converted checkpoints are cached (None: $FREETOKEN_CACHE, else the platform's
    user cache dir). progress: progress bars on conversion and verification. tiering: tuning of
    the tiered memory. record_routing: a file to write the routing of every token the engine runs
    to (`routing_record`; JSON lines, `routing_trace`), None: no trace. routing_profile: a trace of
    this model (such a file) that tiered experts start from: q*'s routing frequencies seeded and
    tier 1 filled with its most used experts at load (`TieredExpertProvider.warm_start`); None:
    no routing known, tier 1 filled with an even share of every layer (`tiering.fill_at_load`).
    cuda_graphs: decode steps replay a captured CUDA graph where the model allows it
    (`decode_runner`; False: always eager).
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True, extra="forbid")

    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    memory: MemoryBudget | None = None
    placement: Placement = "auto"
    expert_quant: ExpertQuant = "auto"
    dense_quant: tuple[DenseQuantPart, ...] = ()
    quant: str | None = None
    cache_dir: Path | None = None
    progress: bool = True
    tiering: TieringOptions = Field(default_factory=TieringOptions)
    record_routing: Path | None = None
    routing_profile: Path | None = None
    cuda_graphs: bool = True

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> str:
        text = str(value).strip()
        if not DEVICE_PATTERN.match(text):
            raise ValueError(f"must be 'cpu' or 'cuda[:N]', got {text!r}")
        return text

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> torch.dtype:
        if isinstance(value, torch.dtype):
            if value not in DTYPES.values():
                raise ValueError(f"must be float32, bfloat16 or float16, got {value}")
            return value
        name = str(value).removeprefix("torch.")
        if name not in DTYPES:
            raise ValueError(f"must be one of {', '.join(DTYPES)}, got {value!r}")
        return DTYPES[name]

    # The one check of the quant options on the options path (the loaders below take the typed
    # values as given); a before-validator so the message names the accepted values as the
    # public entry points built without options do (`int8.check_expert_quant`).
    @field_validator("expert_quant", mode="before")
    @classmethod
    def _expert_quant(cls, value: Any) -> ExpertQuant:
        return check_expert_quant(value, ValueError)

    @field_validator("dense_quant", mode="before")
    @classmethod
    def _dense_quant(cls, value: Any) -> tuple[DenseQuantPart, ...]:
        return check_dense_quant(value, ValueError)

    @classmethod
    def parse(cls, **options: Any) -> EngineOptions:
        """`EngineOptions(**options)`, with EngineError (one line naming the option) for bad input."""
        try:
            return cls(**options)
        except ValidationError as e:
            raise EngineError(f"invalid engine options: {one_line_errors(e)}") from None

    def as_kwargs(self) -> dict[str, Any]:
        """The options as `Engine.from_pretrained` keyword arguments."""
        return {name: getattr(self, name) for name in type(self).model_fields}

    def key(self) -> tuple:
        """What identifies the engine these options load (engines are shared per identical key);
        `progress` does not change what is loaded and is left out."""
        memory = self.memory.model_dump() if self.memory is not None else None
        return (
            self.device,
            str(self.dtype),
            tuple(sorted((memory or {}).items())),
            self.placement,
            self.expert_quant,
            self.dense_quant,
            self.quant,
            str(self.cache_dir) if self.cache_dir is not None else None,
            self.tiering,
            str(self.record_routing) if self.record_routing is not None else None,
            str(self.routing_profile) if self.routing_profile is not None else None,
            self.cuda_graphs,
        )


def one_line_errors(error: ValidationError) -> str:
    """A pydantic ValidationError as '<field>: <message>; ...' on one line."""
    parts = []
    for item in error.errors():
        where = ".".join(str(x) for x in item["loc"]) or "value"
        parts.append(f"{where}: {item['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)
