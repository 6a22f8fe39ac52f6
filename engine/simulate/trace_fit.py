"""Does a routing trace fit a model shape? What a trace covers (`TraceFootprint`: its MoE layers,
largest expert id, top-k, context) and the one-line refusal of a trace that cannot replay on a
shape (`check_trace_fits`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..memory.routing_trace import RoutingRecord, RoutingTraceError

if TYPE_CHECKING:  # only an annotation here
    from .shapes import ModelShape

__all__ = ["TraceFootprint", "check_trace_fits", "trace_footprint"]


@dataclass(frozen=True)
class TraceFootprint:
    """What a routing trace covers: its MoE layers, its largest expert id, experts per record."""

    layers: frozenset[int]
    max_expert: int
    top_k: int
    min_top_k: int
    context: int = 0  # the longest sequence's tokens (its largest token position + 1)


def trace_footprint(records: Iterable[RoutingRecord]) -> TraceFootprint:
    """The layers, largest expert id and top-k (largest and smallest record) of `records`;
    RoutingTraceError for an empty trace."""
    layers: set[int] = set()
    max_expert, top_k, min_top_k, context = -1, 0, None, 0
    for r in records:
        layers.add(r.layer)
        context = max(context, r.token + 1)
        max_expert = max(max_expert, *r.experts)
        top_k = max(top_k, len(r.experts))
        min_top_k = len(r.experts) if min_top_k is None else min(min_top_k, len(r.experts))
    if min_top_k is None:
        raise RoutingTraceError("routing trace is empty: no records")
    return TraceFootprint(frozenset(layers), max_expert, top_k, min_top_k, context)


def check_trace_fits(
    shape: ModelShape,
    layers_seen: Iterable[int],
    max_expert: int,
    top_k: int,
    *,
    all_layers: bool = True,
) -> None:
    """RoutingTraceError, in one line saying what differs, unless a trace with these figures can
    replay on `shape`: its layers are MoE layers of the shape (all of them unless `all_layers` is
    False), its expert ids are below the shape's expert count and it routes `top_k` experts per
    token as the shape does."""
    seen = set(layers_seen)
    moe = set(shape.moe_layers)
    problems = []
    extra = sorted(seen - moe)
    if extra:
        problems.append(
            f"layers {_ranges(extra)} are not MoE layers of {shape.name} (MoE layers: {_ranges(moe)})"
        )
    missing = sorted(moe - seen)
    if all_layers and missing:
        problems.append(f"MoE layers {_ranges(missing)} of {shape.name} have no records")
    if max_expert >= shape.num_experts:
        problems.append(f"expert id {max_expert} >= {shape.name}'s {shape.num_experts} experts")
    if top_k != shape.top_k:
        problems.append(f"top-{top_k} routing where {shape.name} routes top-{shape.top_k}")
    if problems:
        raise RoutingTraceError(f"routing trace does not fit {shape.name}: " + "; ".join(problems))


def _ranges(values: Iterable[int]) -> str:
    """Sorted integers as compact ranges: ``0-2,5``."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and runs[-1][1] == v - 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
