"""The engine's command-line flags (`--device`, `--dtype`, `--fast-mem`, `--host-mem`,
`--placement`, `--expert-quant`, `--record-routing`, `--routing-profile`, `--no-cuda-graphs`),
defined once beside `EngineOptions`, which they fill: every command that loads a model takes them
(`freetoken chat/generate/serve/demo`, and the recipes' own `python -m` programs, which may not
import the CLI above them).

Building a parser with these flags imports nothing heavy (the choices come from `choices`): the
options module and its torch load only when `engine_options` reads the parsed flags, so
`freetoken generate --help` answers at once (issue 65).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .choices import EXPERT_QUANTS, PLACEMENTS

if TYPE_CHECKING:
    from .options import EngineOptions

MEMORY_FLAGS = {"fast_bytes": "--fast-mem", "host_bytes": "--host-mem"}
"""Budget field -> the flag that sets it (errors name the flag)."""


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every command that loads a model takes, passed to the engine unchanged."""
    group = parser.add_argument_group("engine")
    group.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    group.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="compute dtype"
    )
    group.add_argument(
        "--fast-mem",
        default=None,
        metavar="SIZE",
        help="tier 1 budget (VRAM on CUDA, resident experts in RAM on a CPU), shared with the KV "
        "cache: a size such as 8GiB, or a fraction of free memory such as 0.25; tiers the experts",
    )
    group.add_argument(
        "--host-mem",
        default=None,
        metavar="SIZE",
        help="tier 2 budget (host RAM for expert blocks): a size such as 32GiB or a fraction such as "
        "0.5; tiers the experts",
    )
    group.add_argument(
        "--placement",
        default="auto",
        choices=PLACEMENTS,
        help="where experts go: auto (tiered q* when a budget is given or the experts do not fit "
        "free memory), resident, qstar, stream (default auto)",
    )
    group.add_argument(
        "--expert-quant",
        default="auto",
        choices=EXPERT_QUANTS,
        help="compact expert compute: auto (projections stored as int8 stay int8), int8 (quantize "
        "every expert projection), compact (int8 and MXFP4 stay as stored), none (decode "
        "everything to --dtype) (default auto)",
    )
    group.add_argument(
        "--record-routing",
        default=None,
        metavar="PATH",
        type=Path,
        help="write the experts every token is routed to, one JSON line per token and MoE layer "
        "(seq, token, layer, experts, weights, phase), to PATH",
    )
    group.add_argument(
        "--routing-profile",
        default=None,
        metavar="PATH",
        type=Path,
        help="start tiered experts from a routing trace of this model (one --record-routing wrote): "
        "q*'s expert frequencies seeded and fast memory filled with its most used experts at load",
    )
    group.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="decode eagerly on CUDA: no CUDA-graph replay of the decode step",
    )


def engine_options(args: argparse.Namespace, **extra: Any) -> EngineOptions:
    """The EngineOptions the engine arguments in `args` ask for (MemoryBudgetError naming the
    flag for an unreadable size; EngineError for a bad device)."""
    from .memory import MemoryBudget  # torch: only once a command runs, never for --help
    from .options import EngineOptions

    quant = args.expert_quant
    options = EngineOptions.parse(
        device=args.device,
        dtype=args.dtype,
        placement=args.placement,
        expert_quant=quant,
        record_routing=args.record_routing,
        routing_profile=args.routing_profile,
        cuda_graphs=args.cuda_graphs,
        **extra,
    )
    memory = MemoryBudget.from_strings(
        args.fast_mem,
        args.host_mem,
        device=options.device,
        names=(MEMORY_FLAGS["fast_bytes"], MEMORY_FLAGS["host_bytes"]),
    )
    return options.model_copy(update={"memory": memory}) if memory is not None else options
