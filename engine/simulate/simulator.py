"""`simulate`: a routing trace replayed under every policy on one modelled machine, and the bound.

Policies (`POLICIES`): "qstar" and "layer-lru" run through the engine's own tiers, planner and
policy (`replay.TieredReplay`) from a cold start; "qstar-profiled" is q* started from the static
split's profiling pass (`baselines.profiling_steps`: the same routing the static split is placed
by), as the engine starts from a recorded trace (`routing_profile=PATH`); "static", "stream" and
"belady" are the baselines of `baselines`.
Each gives a `PolicyResult`: predicted decode tok/s, misses per token per tier (tier 1: routed
experts not in tier 1; tier 2: blocks read from the disk), bytes per token on each link, experts
computed on the CPU per token, and q*'s decisions.

The bound (`Bound`) is what no policy can beat on this machine: tier 1 run by Belady's offline
optimum at the same budget, and each of its misses served at once by both the link and the CPU
working in parallel (a miss costs link x cpu / (link + cpu) of either's time), beside the device
computing the dense part and every routed expert, and the disk reading what both tiers together
miss under Belady too (exclusive tiers: their budgets' experts, all distinct):
tok/s = tokens / max(device, misses, disk) over the decode steps.
`online_bound` is the same with an LRU cache instead of Belady's: what a policy that cannot see
the future could reach with every link and both processors perfectly overlapped (the published
Mixtral routing misses 2.3x as often under LRU as under Belady with half the experts cached).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..routing_trace import RoutingRecord, Step, group_steps
from .baselines import PROFILE_FRACTION, layer_steps, profiling_steps, replay_static, replay_streaming
from .machine import ExpertCosts
from .profiles import HardwareProfile
from .replay import SimulationError, Tally, TieredReplay
from .shapes import ModelShape, check_trace_fits, codec_name, trace_footprint
from .stats import belady_missing, lru_missing

POLICIES = ("qstar", "qstar-profiled", "layer-lru", "static", "stream", "belady")


@dataclass(frozen=True)
class PolicyResult:
    """One policy's predicted figures over the decode steps (per token). A policy that cannot run
    at this budget (layer-lru needs every layer's top-k in tier 1) has `infeasible`, the reason,
    and no figures (`tokens_per_s` None)."""

    policy: str
    tokens_per_s: float | None
    misses_per_token: dict[str, float]
    bytes_per_token: dict[str, float]
    cpu_experts_per_token: float
    decisions: dict[str, int]
    infeasible: str | None = None

    @classmethod
    def of(cls, policy: str, tally: Tally) -> PolicyResult:
        n = max(1, tally.tokens)
        return cls(
            policy=policy,
            tokens_per_s=tally.tokens / tally.seconds if tally.seconds else None,
            misses_per_token={"fast": tally.fast_misses / n, "host": tally.host_misses / n},
            bytes_per_token={link: b / n for link, b in sorted(tally.bytes.items())},
            cpu_experts_per_token=tally.cpu_experts / n,
            decisions=dict(tally.decisions),
        )


@dataclass(frozen=True)
class Bound:
    """The bound (module docstring): its tok/s, Belady's misses per token per tier, and which
    resource sets it ("device", "misses" or "disk")."""

    tokens_per_s: float
    misses_per_token: dict[str, float]
    limited_by: str


@dataclass(frozen=True)
class SimulationReport:
    """Every policy's result on one machine and budget, labelled as simulated."""

    model: str
    hardware: str
    codec: str
    fast_bytes: int
    host_bytes: int | None
    expert_bytes: int  # one expert's stored bytes in the codec
    total_expert_bytes: int  # every routed expert's, in the codec
    decode_tokens: int
    results: list[PolicyResult]
    bound: Bound
    online_bound: Bound
    profile: str  # what static and qstar-profiled start from
    simulated: bool = True

    def result(self, policy: str) -> PolicyResult:
        return next(r for r in self.results if r.policy == policy)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def bound(
    steps: Sequence[Step],
    layers: Sequence[int],
    costs: ExpertCosts,
    *,
    fast_bytes: int,
    host_bytes: int | None,
    cache: Callable[[Sequence[Sequence[int]], int], list[list[int]]] = belady_missing,
) -> Bound:
    """`Bound` over the decode steps of `steps` (module docstring), both tiers run by `cache`
    (`stats.belady_missing`; `stats.lru_missing` for the online bound)."""
    keyed = layer_steps(steps, layers)
    fast_cap = fast_bytes // costs.fast_bytes
    fast_missing = cache(keyed, fast_cap)
    n_keys = len({k for keys in keyed for k in keys})
    # The disk reads what neither tier holds: RAM and fast memory together hold up to both
    # budgets' distinct experts (exclusive tiers, as q*'s and the static split's), not tier 2's
    # alone (with a small tier 2 that bound read every use from disk, below every policy).
    host_cap = n_keys if host_bytes is None else fast_cap + host_bytes // costs.stored_bytes
    host_missing = cache(keyed, max(host_cap, max(map(len, keyed), default=0)))
    device = fast = disk = 0.0
    tokens = i = 0
    per_miss_link = costs.link_s + costs.decode_s
    per_miss_cpu = costs.host_compute_s(1) + costs.activation_s
    per_miss = per_miss_link * per_miss_cpu / (per_miss_link + per_miss_cpu)
    misses = host_misses = 0
    for step in steps:
        decode = step.phase == "decode"
        for layer in layers:
            routed = step.layers.get(layer, {})
            if decode:
                device += costs.dense_s(step.tokens) + sum(costs.fast_compute_s(t) for t in routed.values())
                misses += len(fast_missing[i])
                host_misses += len(host_missing[i])
            i += 1
        tokens += step.tokens if decode else 0
    # Tier 2 starts warm (as in the replays): the first `host_cap` distinct reads are free.
    warm = min(host_cap, n_keys)
    host_misses = max(0, host_misses - warm)
    fast, disk = misses * per_miss, host_misses * costs.disk_s
    limits = {"device": device, "misses": fast, "disk": disk}
    worst = max(limits, key=lambda k: limits[k])
    n = max(1, tokens)
    return Bound(
        tokens_per_s=tokens / limits[worst] if limits[worst] else 0.0,
        misses_per_token={"fast": misses / n, "host": host_misses / n},
        limited_by=worst,
    )


def simulate(
    records: Sequence[RoutingRecord],
    shape: ModelShape,
    profile: HardwareProfile,
    *,
    fast_bytes: int,
    host_bytes: int | None = None,
    codec: str = "bf16",
    policies: Sequence[str] = POLICIES,
    recall: float = 0.8,
    seed: int = 0,
    routing_profile: Sequence[RoutingRecord] | None = None,
) -> SimulationReport:
    """Replay `records` (a routing trace that fits `shape`) under each of `policies` on `profile`
    with `fast_bytes` of tier 1 and `host_bytes` of tier 2 for experts (None: all fit RAM).
    `routing_profile`: another trace of the model (an earlier session's) that places the static
    split and starts qstar-profiled, as `--routing-profile` starts the engine, instead of the
    trace's own first 25% (`baselines.profiling_steps`): both then predict tokens they never saw.
    RoutingTraceError for a trace or profile that does not fit `shape`; SimulationError for an
    unknown policy or a budget below one layer's working set."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SimulationError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    fp = trace_footprint(records)
    check_trace_fits(shape, fp.layers, fp.max_expert, fp.top_k)
    codec = codec_name(codec)
    steps = group_steps(records)
    if routing_profile is None:
        profiled = profiling_steps(steps)
        source = f"the trace's first {PROFILE_FRACTION:.0%} of decode tokens"
    else:
        pf = trace_footprint(routing_profile)
        check_trace_fits(shape, pf.layers, pf.max_expert, pf.top_k, all_layers=False)
        profiled = group_steps(routing_profile)
        tokens = sum(s.tokens for s in profiled)
        source = f"a routing profile of {tokens} tokens"
    layers = list(shape.moe_layers)
    costs = ExpertCosts.of(shape, profile, codec)
    if fast_bytes < costs.fast_bytes * shape.top_k:
        raise SimulationError(
            f"fast memory of {fast_bytes} bytes cannot hold one layer's top-{shape.top_k} experts "
            f"({costs.fast_bytes * shape.top_k} bytes)"
        )
    results = []
    for policy in policies:
        if policy in ("qstar", "qstar-profiled", "layer-lru"):
            try:
                replay = TieredReplay(
                    shape,
                    profile,
                    codec=codec,
                    fast_bytes=fast_bytes,
                    host_bytes=host_bytes,
                    placement="layer-lru" if policy == "layer-lru" else "qstar",
                    recall=recall,
                    seed=seed,
                    warm_start=profiled if policy == "qstar-profiled" else (),
                )
            except SimulationError as e:
                results.append(PolicyResult(policy, None, {}, {}, 0.0, {}, infeasible=str(e)))
                continue
            tally = replay.run(steps)
        elif policy == "static":
            tally = replay_static(
                steps,
                layers,
                costs,
                fast_bytes=fast_bytes,
                host_bytes=host_bytes,
                num_experts=shape.num_experts,
                profile=profiled,
            )
        else:
            tally = replay_streaming(
                steps,
                layers,
                costs,
                fast_bytes=fast_bytes,
                host_bytes=host_bytes,
                num_experts=shape.num_experts,
                cached=policy == "belady",
            )
        results.append(PolicyResult.of(policy, tally))
    return SimulationReport(
        model=shape.name,
        hardware=profile.name,
        codec=codec,
        fast_bytes=fast_bytes,
        host_bytes=host_bytes,
        expert_bytes=costs.stored_bytes,
        total_expert_bytes=shape.total_expert_bytes(codec),
        decode_tokens=sum(s.tokens for s in steps if s.phase == "decode"),
        results=results,
        bound=bound(steps, layers, costs, fast_bytes=fast_bytes, host_bytes=host_bytes),
        online_bound=bound(
            steps, layers, costs, fast_bytes=fast_bytes, host_bytes=host_bytes, cache=lru_missing
        ),
        profile=source,
    )
