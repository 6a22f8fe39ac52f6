"""`simulate`: a routing trace replayed under every policy on one modelled machine, and the bound.

Policies (`POLICIES`): "qstar" and "layer-lru" run through the engine's own tiers, planner and
policy (`replay.TieredReplay`) with no routing known (q*'s tier 1 filled at load with an even
share of every layer, as the engine does; the per-layer LRU's empty); "qstar-profiled" is q*
started from the static split's profiling pass (`baselines.profiling_steps`: the same routing
the static split is placed by), as the engine starts from a recorded trace
(`routing_profile=PATH`); "static", "stream" and "belady" are the baselines of `baselines`.
Each gives a `PolicyResult`: predicted decode tok/s, misses per token per tier (tier 1: routed
experts not in tier 1; tier 2: blocks read from the disk), bytes per token on each link, experts
computed on the CPU per token, and q*'s decisions.

The bound (`Bound`) is what no policy can beat on this machine: tier 1 run by Belady's offline
optimum at the same budget, filled at load as every policy's is (`stats.filled_at_load`: the
experts used first, untimed), each of its misses served by the link or the CPU, whichever the bound
finds best, beside the device computing the dense part and every routed expert the CPU does not,
and the disk reading what both tiers together miss under Belady too (exclusive tiers: their
budgets' experts, all distinct). The link may work ahead of the layers (an oracle prefetch with
room to spare), but a miss computed on the CPU needs its layer's hidden state: the layers run one
after another, each taking its dense part and then the longer of its device experts and its CPU
misses (`bounds.LayerChain`):
tok/s = tokens / max(layer chain, link, disk) over the decode steps.
(Until 2026-12 the CPU's misses were summed over the whole trace as if a layer's misses could be
computed during other layers' work, which no policy can do: the Mixtral / RTX 4090 / 50% bound
read 81.7 tok/s where 58.4 is what the dependency allows.)
`online_bound` is the same with an LRU cache instead of Belady's: what a policy that cannot see
the future could reach with every link and both processors perfectly overlapped (the published
Mixtral routing misses 2.3x as often under LRU as under Belady with half the experts cached).
(Until 2026-12-07 both bounds and Belady streaming started with tier 1 empty and paid a copy for
every expert they then held, which q* and the static split get at load: on Qwen3-30B-A3B / RTX
4090 / 50%, 300 tokens, ~10 copies a token, Belady 137.3 tok/s where 158.5 is its speed filled.)

The trace is streamed (`source`): each policy and each bound walks it once, a step at a time,
and keeps running totals; what is kept across walks is Belady's next use of every routed expert
(`caches.NextUses`, 4 bytes each: ~1.5 KiB a Qwen3-30B-A3B decode token), where ~47.5 KB a token
was held before (every record and step).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..memory.routing_trace import Step
from .baselines import PROFILE_FRACTION, profiling_steps, replay_static, replay_streaming
from .bounds import Bound, BoundTally, LayerChain, bound, bound_tally
from .engine_costs import EngineCosts, priced
from .fit import FitError, check_fits
from .machine import ExpertCosts
from .profiles import HardwareProfile
from .replay import SimulationError, Tally, TieredReplay
from .shapes import ModelShape, codec_name
from .source import RecordSource, TraceSource, trace_source
from .trace_fit import check_trace_fits

__all__ = [
    "POLICIES",
    "Bound",
    "FitError",
    "LayerChain",
    "PolicyResult",
    "SimulationReport",
    "bound",
    "simulate",
]

POLICIES = ("qstar", "qstar-profiled", "layer-lru", "static", "static-layers", "stream", "belady")
_ENGINE_POLICIES = ("qstar", "qstar-profiled", "layer-lru")
"""Policies run through the engine's own tiered provider: they pay its bookkeeping (`engine_costs`)."""
_NO_TIER1_FLOOR = ("static", "static-layers")
"""Policies that run with less tier 1 than one layer's top-k (llama.cpp's -cmoe: none at all)."""


@dataclass(frozen=True)
class PolicyResult:
    """One policy's predicted figures over the decode steps (per token). A policy that cannot run
    at this budget (layer-lru needs every layer's top-k in tier 1) has `infeasible`, the reason,
    and no figures (`tokens_per_s` None). `overlapped_tokens_per_s` (the policies run through the
    engine's tiers): its own tier-1 misses served as the bound serves Belady's, every link and both
    processors perfectly overlapped: what better scheduling alone could reach, short of missing
    less."""

    policy: str
    tokens_per_s: float | None
    misses_per_token: dict[str, float]
    bytes_per_token: dict[str, float]
    cpu_experts_per_token: float
    decisions: dict[str, int]
    infeasible: str | None = None
    overlapped_tokens_per_s: float | None = None

    @classmethod
    def of(cls, policy: str, tally: Tally, overlapped: float | None = None) -> PolicyResult:
        n = max(1, tally.tokens)
        return cls(
            policy=policy,
            tokens_per_s=tally.tokens / tally.seconds if tally.seconds else None,
            misses_per_token={"fast": tally.fast_misses / n, "host": tally.host_misses / n},
            bytes_per_token={link: b / n for link, b in sorted(tally.bytes.items())},
            cpu_experts_per_token=tally.cpu_experts / n,
            decisions=dict(tally.decisions),
            overlapped_tokens_per_s=overlapped,
        )


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
    # What the policies run through the engine's tiered provider were charged for its bookkeeping
    # (`engine_costs.EngineCosts` as a dict, and "charged": those policies among the ones run).
    engine_costs: dict[str, Any] = field(default_factory=dict)
    simulated: bool = True

    def result(self, policy: str) -> PolicyResult:
        return next(r for r in self.results if r.policy == policy)

    def costs_line(self) -> str:
        """One line saying which of the engine's own costs the replay priced, and for which
        policies (empty when none of them ran)."""
        c = self.engine_costs
        if not c.get("charged"):
            return ""
        what = EngineCosts(c["tier_us"], c["miss_us"], c["stream_us"], c["source"]).line()
        return f"engine costs priced for {', '.join(c['charged'])}: {what}\n"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def simulate(
    records: RecordSource | TraceSource,
    shape: ModelShape,
    profile: HardwareProfile,
    *,
    fast_bytes: int,
    host_bytes: int | None = None,
    codec: str = "bf16",
    policies: Sequence[str] = POLICIES,
    recall: float = 0.8,
    seed: int = 0,
    routing_profile: RecordSource | TraceSource | None = None,
    dense_codec: str | None = None,
    context: int | None = None,
    check_fit: bool = True,
) -> SimulationReport:
    """Replay `records` (a routing trace that fits `shape`: records in memory, a trace file's path
    or a `source.TraceSource`, streamed a step at a time, once per pass) under each of `policies`
    on `profile` with `fast_bytes` of tier 1 and `host_bytes` of tier 2 for experts (None: all fit
    RAM). `routing_profile`: another trace of the model (an earlier session's) that places the
    static split and starts qstar-profiled, as `--routing-profile` starts the engine, instead of
    the trace's own first 25% (`baselines.profiling_steps`): both then predict tokens they never
    saw. `dense_codec`: what the dense weights are held in (None: the engine's compute dtype);
    `context`: the tokens whose KV the device holds (None: the trace's longest sequence).
    RoutingTraceError for a trace or profile that does not fit `shape`; SimulationError for
    an unknown policy or a budget below one layer's working set; FitError (`fit.check_fits`,
    unless `check_fit` is False) when fast memory, the dense weights and the KV cache do not fit
    the machine."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SimulationError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    steps = trace_source(records)
    fp = steps.footprint()
    check_trace_fits(shape, fp.layers, fp.max_expert, fp.top_k)
    codec = codec_name(codec)
    layers = list(shape.moe_layers)
    profiled: Callable[[], Iterable[Step]]
    if routing_profile is None:

        def profiled() -> Iterable[Step]:
            return profiling_steps(steps, decode_steps=figures.decode_steps)

        source = f"the trace's first {PROFILE_FRACTION:.0%} of decode tokens"
    else:
        profile_steps = trace_source(routing_profile)
        pf = profile_steps.footprint()
        check_trace_fits(shape, pf.layers, pf.max_expert, pf.top_k, all_layers=False)
        profiled = profile_steps.__iter__
        tokens = sum(s.tokens for s in profiled())
        source = f"a routing profile of {tokens} tokens"
    dense = codec_name(dense_codec) if dense_codec else ("fp32" if profile.device == "cpu" else "bf16")
    if check_fit:
        check_fits(
            shape,
            profile,
            fast_bytes=fast_bytes,
            host_bytes=host_bytes,
            dense_codec=dense,
            context=fp.context if context is None else context,
        )
    costs = ExpertCosts.of(shape, profile, codec, dense_codec=dense)
    floor_free = all(p in _NO_TIER1_FLOOR for p in policies)
    if fast_bytes < costs.fast_bytes * shape.top_k and not floor_free:
        raise SimulationError(
            f"fast memory of {fast_bytes} bytes cannot hold one layer's top-{shape.top_k} experts "
            f"({costs.fast_bytes * shape.top_k} bytes)"
        )
    figures = steps.figures(layers)  # one walk; the next uses Belady needs (`source`)
    budgets: dict[str, Any] = dict(fast_bytes=fast_bytes, host_bytes=host_bytes)
    the_bound = bound_tally(steps, layers, costs, **budgets, figures=figures)
    results = []
    for policy in policies:
        overlapped = None  # the engine's policies: their own misses, perfectly overlapped
        if policy in _ENGINE_POLICIES:
            try:
                replay = TieredReplay(
                    shape,
                    profile,
                    codec=codec,
                    **budgets,
                    placement="layer-lru" if policy == "layer-lru" else "qstar",
                    recall=recall,
                    seed=seed,
                    warm_start=profiled() if policy == "qstar-profiled" else (),
                )
            except SimulationError as e:
                results.append(PolicyResult(policy, None, {}, {}, 0.0, {}, infeasible=str(e)))
                continue
            # Its own tier-1 misses served as the bound serves Belady's, the disk's as the bound's.
            own = BoundTally(costs, host_misses=the_bound.host_misses, warm=the_bound.warm)
            tally = replay.run(steps, on_layer=own.on_layer)
            overlapped = own.result().tokens_per_s
        elif policy in ("static", "static-layers"):
            by_layer = policy == "static-layers"
            tally = replay_static(
                steps,
                layers,
                costs,
                **budgets,
                num_experts=shape.num_experts,
                profile=() if by_layer else profiled(),
                by_layer=by_layer,
            )
        else:
            tally = replay_streaming(
                steps,
                layers,
                costs,
                **budgets,
                num_experts=shape.num_experts,
                cached=policy == "belady",
                figures=figures,
            )
        results.append(PolicyResult.of(policy, tally, overlapped))
    return SimulationReport(
        model=shape.name,
        hardware=profile.name,
        codec=codec,
        fast_bytes=fast_bytes,
        host_bytes=host_bytes,
        expert_bytes=costs.stored_bytes,
        total_expert_bytes=shape.total_expert_bytes(codec),
        decode_tokens=figures.decode_tokens,
        results=results,
        bound=the_bound.result(),
        online_bound=bound(steps, layers, costs, **budgets, cache="lru", figures=figures),
        profile=source,
        engine_costs={
            **asdict(priced(shape, profile)),
            "charged": [p for p in policies if p in _ENGINE_POLICIES],
        },
    )
