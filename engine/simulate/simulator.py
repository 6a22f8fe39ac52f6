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
misses (`_layer_chain`):
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
from .stats import belady_missing, filled_at_load, lru_missing

POLICIES = ("qstar", "qstar-profiled", "layer-lru", "static", "stream", "belady")


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
class Bound:
    """The bound (module docstring): its tok/s, Belady's misses per token per tier, and which
    resource sets it: "layers" (the chain of layers, each its dense part and then its device
    experts beside its CPU misses), "link" or "disk"."""

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
    fast_missing: Sequence[Sequence[int]] | None = None,
) -> Bound:
    """`Bound` over the decode steps of `steps` (module docstring), both tiers run by `cache`
    (`stats.belady_missing`; `stats.lru_missing` for the online bound), or tier 1's misses given
    (`fast_missing`, a replay's own: `TieredReplay.missed`, in `layer_steps`' keys; SimulationError
    unless it has one entry per step and layer)."""
    keyed = layer_steps(steps, layers)
    if fast_missing is not None and len(fast_missing) != len(keyed):
        raise SimulationError(
            f"fast_missing has {len(fast_missing)} entries; the steps have {len(keyed)} "
            f"({len(steps)} steps x {len(layers)} MoE layers)"
        )
    fast_cap = fast_bytes // costs.fast_bytes
    if fast_missing is None:
        fast_missing = filled_at_load(cache(keyed, fast_cap), fast_cap)  # filled at load, as q*'s
    n_keys = len({k for keys in keyed for k in keys})
    # The disk reads what neither tier holds: RAM and fast memory together hold up to both
    # budgets' distinct experts (exclusive tiers, as q*'s and the static split's), not tier 2's
    # alone (with a small tier 2 that bound read every use from disk, below every policy).
    host_cap = n_keys if host_bytes is None else fast_cap + host_bytes // costs.stored_bytes
    host_missing = cache(keyed, max(host_cap, max(map(len, keyed), default=0)))
    link = costs.link_s + costs.decode_s  # a miss served by the link (and decoded on the device)
    cpu = costs.host_compute_s(1)  # one served by the CPU (its fewest tokens: a bound)
    chain = LayerChain(link=link, cpu=cpu)
    misses = host_misses = 0
    tokens = i = 0
    for step in steps:
        decode = step.phase == "decode"
        for layer in layers:
            routed = step.layers.get(layer, {})
            if decode:
                computes = [costs.fast_compute_s(t) for t in routed.values()]
                chain.add(costs.dense_s(step.tokens), computes, len(fast_missing[i]))
                misses += len(fast_missing[i])
                host_misses += len(host_missing[i])
            i += 1
        tokens += step.tokens if decode else 0
    # Tier 2 starts warm (as in the replays): the first `host_cap` distinct reads are free.
    warm = min(host_cap, n_keys)
    host_misses = max(0, host_misses - warm)
    layers_s, link_s = chain.balance()
    limits = {"layers": layers_s, "link": link_s, "disk": host_misses * costs.disk_s}
    top = max(limits.values())
    # Balanced, the chain and the link take equally long: the chain is named (ties go first).
    worst = next(k for k, v in limits.items() if v >= top * (1 - 1e-9))
    n = max(1, tokens)
    return Bound(
        tokens_per_s=tokens / limits[worst] if limits[worst] else 0.0,
        misses_per_token={"fast": misses / n, "host": host_misses / n},
        limited_by=worst,
    )


@dataclass
class LayerChain:
    """The decode steps' layers, one after another, each with its misses split between the CPU
    (within the layer, beside its device experts) and the link (any time before: an oracle
    prefetch), the split that `balance` makes best. Per layer, the CPU taking c of m misses
    makes it last dense + max(device experts - c x the largest device compute, c x `cpu`): free
    while the CPU finishes first (c up to where the two meet), then `cpu` a miss more, each one
    `link` less for the link. Fractional c: a miss split between the two, as q*'s SPLIT does."""

    link: float  # seconds a miss takes the link
    cpu: float  # seconds a miss takes the CPU
    free_chain: float = 0.0  # the layers with each one's free CPU share taken
    free_link: float = 0.0  # the link's misses left after those shares
    movable: float = 0.0  # misses the CPU could still take, at `cpu` each on the chain

    def add(self, dense: float, computes: Sequence[float], misses: int) -> None:
        """One layer of one step: `dense` seconds, its routed experts' device compute times, and
        how many of them miss tier 1."""
        device, largest = sum(computes), max(computes, default=0.0)
        meet = device / (largest + self.cpu) if largest + self.cpu > 0 else 0.0
        taken = min(float(misses), meet)
        self.free_chain += dense + max(device - taken * largest, taken * self.cpu)
        self.free_link += (misses - taken) * self.link
        self.movable += misses - taken

    def balance(self) -> tuple[float, float]:
        """(the chain of layers, the link) in seconds, with the misses past each layer's free CPU
        share moved from the link to the CPU until the two take equally long (or none is left)."""
        step = self.cpu + self.link
        moved = min(max((self.free_link - self.free_chain) / step, 0.0), self.movable) if step else 0.0
        return self.free_chain + moved * self.cpu, self.free_link - moved * self.link


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
        overlapped = None  # the engine's policies: their own misses, perfectly overlapped
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
            overlapped = bound(
                steps, layers, costs, fast_bytes=fast_bytes, host_bytes=host_bytes, fast_missing=replay.missed
            ).tokens_per_s
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
        results.append(PolicyResult.of(policy, tally, overlapped))
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
