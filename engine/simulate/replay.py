"""Replay a routing trace through the engine's own tiered memory on a modelled machine.

`replay_tiered(steps, shape, profile, ...)` runs the decisions of `TieredExpertProvider` without
weights: the same tier classes (`FastTier` with its pinned hot set, or `LayerLRUTier` for the
"layer-lru" baseline; one `HostTier` for all layers ranked by `RoutingFrequency`), the same
`ExpertPlanner` and policy (`QStarPolicy`, or `AlwaysStreamPolicy` for "layer-lru"), the same
`BandwidthOracle`s and `ComputeCostModel` (fed the modelled transfers and compute on a virtual
clock, so q* learns the machine as it would live) and the same `Prefetcher`. What the live
provider's `TierMover` does with bytes, `VirtualMover` does with time on a `machine.Timeline`.

Pre-gating has no router to run in a replay: an oracle predictor stands in for it. For each of
the next `prefetch_depth` layers it predicts the experts the trace really routes there, each kept
with probability `recall` (seeded), the rest of its top-k filled with the layer's most frequent
experts, as the live predictor fills with its priors. Whether a routed expert is kept is drawn
once per step: a layer is predicted again from each nearer layer, and pre-gating from successive
layers reads nearly the same hidden state, so it misses the same experts. (Drawn anew at each
prediction, the union of a layer's `prefetch_depth` predictions held ~99% of its experts at
recall 0.8, plus the wrong fillers of every draw: not the set recall.)

A step is one decode token, or one sequence's prefill records together (each layer then runs
once with every expert its tokens route to, with their token counts, as the live engine does).
Figures count decode steps only.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from typing import Any

from ..errors import EngineError
from ..memory.fast_tier import FastTier, LayerLRUTier
from ..memory.oracle import BandwidthOracle, ManualClock
from ..memory.planner import ExpertPlanner
from ..memory.policy import DOWN_SHARE, AlwaysStreamPolicy, ComputeCostModel, Placement, QStarPolicy
from ..memory.prefetch import Prefetcher
from ..memory.recent import RecentCopies
from ..memory.routing import ROUTING_DECAY, RoutingFrequency
from ..memory.routing_trace import Step
from ..memory.tiers import HostTier
from ..model.experts import ExpertKey
from .machine import ExpertCosts, Timeline, moves_whole
from .mover import Tally, VirtualMover, warm
from .profiles import HardwareProfile
from .shapes import ModelShape

__all__ = ["OnLayer", "SimulationError", "Tally", "TieredReplay", "VirtualMover", "warm"]


class SimulationError(EngineError, ValueError):
    """A replay that cannot run (a budget below one layer's working set, an unknown policy)."""


OnLayer = Callable[[Step, int, list[int]], None]
"""`TieredReplay.run`'s hook: a (step, MoE layer) and the keys of its routed experts that missed."""


def _given(steps: Iterable[Step]) -> Iterable[Step] | None:
    """`steps`, or None for an empty collection (no routing profile given)."""
    return None if isinstance(steps, Collection) and not steps else steps


class TieredReplay:
    """The live provider's per-layer loop over `steps`, on the modelled machine (module docstring).

    `placement`: "qstar" or "layer-lru" (the live "stream" placement: per-layer LRU, always
    stream, no CPU compute, tiers not exclusive). `fast_bytes`: tier 1's room for experts;
    `host_bytes`: tier 2's (None: unbounded). `warm_host`: tier 2 starts full (the steady state;
    False: empty, as a freshly loaded engine). `warm_start`: q* starts from this recorded routing
    as the live provider does with a routing profile (`ExpertPlanner.warm_start`: the frequencies
    seeded, tier 1 filled with the most used experts, untimed: the engine does it while loading).
    Without one q* fills tier 1 as the engine does at load (`ExpertPlanner.load_fill`, untimed)
    unless `fill_at_load` is False (tier 1 empty).
    `policy` and `costs` replace the ones the profile gives (tests: a live run's frozen costs and
    its experts' sizes)."""

    def __init__(
        self,
        shape: ModelShape,
        profile: HardwareProfile,
        *,
        codec: str,
        fast_bytes: int,
        host_bytes: int | None,
        placement: str = "qstar",
        prefetch_depth: int = 3,
        recall: float = 0.8,
        seed: int = 0,
        hot_every: int = 16,
        decay: float = ROUTING_DECAY,
        policy: QStarPolicy | None = None,
        costs: ExpertCosts | None = None,
        warm_host: bool = True,
        warm_start: Iterable[Step] = (),
        fill_at_load: bool = True,
    ) -> None:
        if placement not in ("qstar", "layer-lru"):
            raise SimulationError(f"placement must be 'qstar' or 'layer-lru', got {placement!r}")
        profiled = _given(warm_start)  # walked once, at the end of loading
        if profiled is not None and placement != "qstar":
            raise SimulationError("a warm start (routing profile) is for placement 'qstar' only")
        self.shape, self.profile, self.placement = shape, profile, placement
        self.costs = c = costs or ExpertCosts.of(shape, profile, codec)
        self.layers = list(shape.moe_layers)
        self.top_k = shape.top_k
        keys = [(lay, e) for lay in self.layers for e in range(shape.num_experts)]
        self.clock = ManualClock()
        self.timeline = Timeline(profile.device)
        exclusive = placement == "qstar"
        self.routing = RoutingFrequency(self.layers, decay)
        dev = profile.device
        storage = BandwidthOracle("storage->host", clock=self.clock, prior_bps=1e9)
        fast_link = BandwidthOracle("host->fast", clock=self.clock, prior_bps=1e10)
        acts = BandwidthOracle("activations", clock=self.clock, prior_bps=1e10) if dev == "cuda" else None
        policy_cls = QStarPolicy if exclusive else AlwaysStreamPolicy
        self.policy = policy or policy_cls(
            storage, fast_link, acts, ComputeCostModel(), fast_device=dev, host_device="cpu-host"
        )
        storage, fast_link = self.policy.storage, self.policy.host_fast
        min_ws = c.fast_bytes * self.top_k * (1 if exclusive else len(self.layers))
        if fast_bytes < min_ws:
            raise SimulationError(
                f"fast memory of {fast_bytes} bytes cannot hold the minimum expert working set of "
                f"{min_ws} bytes ({'one layer' if exclusive else 'every layer'}'s top-{self.top_k})"
            )
        # CUDA prefetch stages copies for the next `prefetch_depth` layers, room taken from tier 1:
        # for every predicted expert until a layer time is measured (`_refit_staging`).
        depth = max(0, prefetch_depth)
        # The "stream" baseline (per-layer LRU) keeps the room it was measured with: every layer's
        # top-k per layer ahead.
        self.fast_total, self.min_ws = fast_bytes, min_ws
        per_layer = c.fast_bytes * self.top_k if exclusive else min_ws
        self.spare = self._spare_for(depth * per_layer if dev == "cuda" else 0)
        protected = self._needed_soon
        if exclusive:
            fast: FastTier[Any] = FastTier(None, protected=protected)
        else:
            fast = LayerLRUTier(None, len(self.layers), protected=protected)
        host: HostTier[Any] = HostTier(
            host_bytes, rank=self.routing if exclusive else None, protected=protected
        )
        moves_up = {k for k in keys if exclusive and moves_whole(c.codec, dev)}
        self.mover = VirtualMover(
            fast,
            host,
            c,
            self.timeline,
            (storage, fast_link),
            self.clock,
            moves_up=moves_up,
            exclusive=exclusive,
        )
        fast.on_evict = self.mover.on_fast_evict
        fast.resize(fast_bytes - self.spare)
        if warm_host:
            self.mover.warm_host(keys)
        self.fast, self.host = fast, host
        self.planner = ExpertPlanner(
            fast=fast,
            host=host,
            policy=self.policy,
            routing=self.routing,
            layers=self.layers,
            stored_bytes=dict.fromkeys(keys, c.stored_bytes),
            fast_bytes=dict.fromkeys(keys, c.fast_bytes),
            codecs=dict.fromkeys(keys, c.codec),
            link_bytes=lambda _k: c.stored_bytes,
            moves_up=moves_up,
            device=dev,
            hot_every=hot_every,
            clock=self.clock,
        )
        self.prefetcher = Prefetcher(self._prefetch_load, use_thread=False) if prefetch_depth else None
        self.prefetch_depth = depth
        self.hot_every = hot_every
        self.planner.room = self.spare // c.fast_bytes if self.spare else None
        if profiled is not None:
            for key in self.planner.warm_start(profiled):
                self.mover.land(key)
            self.planner.refresh_hot()
        elif exclusive and fill_at_load:
            for key in self.planner.load_fill():
                self.mover.land(key)
        self.spare_wanted = exclusive and dev == "cuda" and bool(depth) and self.prefetcher is not None
        if self.spare_wanted:  # as the live provider: staged copies kept a while (`RecentCopies`)
            self.planner.recent = RecentCopies(
                fast,
                self.routing,
                slot_bytes=c.fast_bytes,
                top_k=self.top_k,
                floor_bytes=min_ws,
                window=hot_every,
                miss_s=lambda: self.policy.compute.estimate(self.policy.host_device, c.codec, 1),
                keep_s=c.stream_overhead_s,  # a kept copy's tier moves, priced as a STREAM's
            )
        self.recall = recall
        self.rng = random.Random(seed)
        self.now = 0.0
        self._draws: dict[ExpertKey, float] = {}  # the predictor's draw per routed expert, this step
        self._on_layer: OnLayer | None = None  # `run`'s hook

    def _spare_for(self, wanted: int) -> int:
        """A staging room of `wanted` bytes, or none if tier 1 would be left less than the minimum
        working set (as the live provider's `_target_spare`)."""
        return wanted if self.fast_total - wanted >= self.min_ws else 0

    def _refit_staging(self) -> None:
        """As the live provider's: every `hot_every` steps the staging room follows what the link
        can fill (`ExpertPlanner.staging_room`), the rest is tier 1's."""
        room = self.planner.staging_room(self.prefetch_depth, self.top_k)
        if self.planner.room_settled(room):
            return
        spare = self._spare_for(room * self.costs.fast_bytes)
        if spare != self.spare:
            self.spare = spare
            self.planner.room = spare // self.costs.fast_bytes if spare else None
            self.fast.resize(self.fast_total - spare)

    def _needed_soon(self, key: Any) -> bool:
        return self.planner.needed_soon(key)

    def _prefetch_load(self, key: ExpertKey) -> float | None:
        stage = bool(self.spare) and self.planner.should_stage(key)
        return self.mover.prefetch_load(key, stage=stage)

    def _in_ram(self, key: ExpertKey) -> bool:
        return key in self.fast or (self.costs.device != "cuda" and key in self.host)

    def _predict(self, layer: int, truth: dict[int, int], tokens: int) -> list[int]:
        """The oracle predictor: the truly routed experts kept with probability `recall`, then the
        layer's most frequent others, up to top-k (decode) or twice that (prefill). An expert is
        kept or missed once per step, whichever layer predicts it (module docstring)."""
        limit = self.top_k * (1 if tokens == 1 else 2)
        draw = self._draws
        by_tokens = sorted(truth, key=lambda e: -truth[e])
        pred = [e for e in by_tokens if draw.setdefault((layer, e), self.rng.random()) < self.recall]
        counts = self.routing.by_layer[layer]
        for e in sorted(counts, key=lambda e: -counts[e]):
            if len(pred) >= limit:
                break
            if e not in pred:
                pred.append(e)
        return pred[:limit]

    # ---- the per-layer loop -----------------------------------------------------------------
    def run(self, steps: Iterable[Step], on_layer: OnLayer | None = None) -> Tally:
        """Replay `steps` (walked once, in order: a stream is never held); the tally of the decode
        steps. `on_layer(step, layer, missed)`: after each (step, MoE layer), the routed experts
        that missed tier 1 there, keyed as `source.step_keys` (`bounds.BoundTally` counts them)."""
        tally = Tally()
        self._on_layer = on_layer
        for step in steps:
            decode = step.phase == "decode"
            before = (self.now, Counter(self.mover.bytes), Counter(self.policy.decisions))
            host_misses = self.host.counters.misses
            fast_misses = self._run_step(step)
            if not decode:
                continue
            tally.tokens += step.tokens
            tally.seconds += self.now - before[0]
            tally.fast_misses += fast_misses
            tally.host_misses += self.host.counters.misses - host_misses
            tally.bytes.update(self.mover.bytes - before[1])
            delta = self.policy.decisions - before[2]
            tally.decisions.update(delta)
            tally.cpu_experts += delta[Placement.HOST.value] + delta[Placement.SPLIT.value]  # SPLIT: mostly
        return tally

    def _run_step(self, step: Step) -> int:
        c, t = self.costs, step.tokens
        misses = 0
        self._draws.clear()
        for pos, layer in enumerate(self.layers):
            routed = step.layers.get(layer, {})
            used = sorted(routed)
            start = self.mover.now = self.clock.now = self.now
            # In RAM: tier 2, and the tier-1 experts whose bytes moved up (one codec for every
            # expert: all of them move up whole or none does).
            in_ram = len(self.host) + (len(self.fast) if self.mover.moves_up else 0)
            pregating = self.prefetcher is not None and self.planner.prefetch_has_work(in_ram)
            # tier_overhead_us is what pre-gating and its bookkeeping cost a layer (measure.py)
            hidden = self.timeline.run(
                "device", start, c.dense_s(t) + (c.tier_overhead_s if pregating else 0.0)
            )
            self.planner.note_routing(layer, used)
            if pos == 0 and self.spare_wanted and self.planner.steps % self.hot_every == 0:
                self._refit_staging()
            if pregating:
                self.planner.begin_layer(layer, used)
                self.prefetcher.begin_layer(layer, used)
                for nxt in self.layers[pos + 1 : pos + 1 + self.prefetch_depth]:
                    pred = self._predict(nxt, step.layers.get(nxt, {}), t)
                    self.planner.expect(nxt, pred)
                    self.prefetcher.issue(nxt, pred, skip=self._in_ram)
            ends = [hidden]
            resident = self.fast.hits(layer, used) if t == 1 else None  # as the live provider
            missed_here: list[int] = []
            if resident is not None:
                self.policy.count_resident(len(used), 1)
                for e in used:
                    ends.append(self._fast_compute(hidden, 0.0, routed[e]))
            else:
                for e in used:
                    end, missed = self._expert(layer, e, routed[e], hidden)
                    ends.append(end)
                    misses += missed
                    if missed:
                        missed_here.append(pos << 20 | e)
            if self._on_layer is not None:
                self._on_layer(step, layer, missed_here)
            self.now = max(ends)
        return misses

    def _fast_compute(self, hidden: float, ready: float, tokens: int) -> float:
        s = self.costs.fast_compute_s(tokens)
        self.policy.compute.observe(self.costs.device, "decoded", tokens, s)
        return self.timeline.run("device", max(hidden, ready), s)

    def _expert(self, layer: int, e: int, tokens: int, hidden: float) -> tuple[float, int]:
        """One routed expert as `TieredExpertProvider._compute` runs it: (when it ends, 1 if it
        missed tier 1). A demand read or copy starts once the layer's routing is known (`hidden`:
        its hidden state, after the router) and q* has decided, as the live engine issues it."""
        key, c = (layer, e), self.costs
        if self.fast.get(key) is not None:
            self.policy.count_resident(1, tokens)
            return self._fast_compute(hidden, 0.0, tokens), 0
        staged = self.prefetcher.take(key) if self.prefetcher is not None else None
        act = c.activation_bytes * tokens
        place = self.planner.decide(key, tokens, staged=staged is not None, activation_bytes=act)
        keep = place is Placement.STAGED and self.planner.keeps_staged(key)
        # The decision (and a STREAM's or a kept copy's tier moves) on the thread that runs the layer.
        moved = place is Placement.STREAM or keep
        overhead = c.miss_overhead_s + (c.stream_overhead_s if moved else 0.0)
        if overhead:
            hidden = self.timeline.run("cpu", hidden, overhead)
        if place is Placement.HOST:
            cuda_or_not_staged = c.device == "cuda" or staged is None
            ready = self.mover.host_value(key, hidden) if cuda_or_not_staged else staged
            if c.device == "cuda":  # hidden states device -> host and back: tiny, latency-bound
                self.mover.bytes["activations"] += act
                hidden += c.activation_s * tokens
            s = c.host_compute_s(tokens)
            self.policy.compute.observe("cpu-host", c.codec, tokens, s)
            return self.timeline.run("cpu", max(ready, hidden), s), 1
        if place is Placement.STAGED:  # the staged copy, used and let go or kept a while
            if keep:
                self.mover.land(key, recent=True)
            return self._fast_compute(hidden, staged or 0.0, tokens), 1
        if place is Placement.SPLIT:
            return self._split(key, tokens, hidden), 1
        ready = self.mover.promote(key, hidden, staged)
        if c.decode_s and key not in self.mover.moves_up:
            self.policy.compute.observe(c.device, f"decode/{c.codec}", 1, c.decode_s)
            ready = self.timeline.run("device", ready, c.decode_s)
        return self._fast_compute(hidden, ready, tokens), 1

    def _split(self, key: ExpertKey, tokens: int, hidden: float) -> float:
        """A SPLIT as `TieredExpertProvider._split_compute` runs it: the link copies the device's
        share of the down projection's rows while the CPU computes gate/up and the other rows;
        the device computes its rows once they and the CPU's gate/up output are there."""
        c, share = self.costs, self.planner.take_split(key)
        ready = self.mover.host_value(key, hidden)
        hidden += c.activation_s * tokens  # hidden states device -> host and back
        s = c.host_compute_s(tokens)
        self.policy.compute.observe("cpu-host", c.codec, tokens, s)  # live: its time / its CPU share
        cpu_start = max(ready, hidden, self.timeline.free["cpu"])
        cpu_end = self.timeline.run("cpu", cpu_start, (1 - DOWN_SHARE * share) * s)
        gate_up = cpu_start + (1 - DOWN_SHARE) * s
        rows = self.mover.copy_rows(int(DOWN_SHARE * share * c.fast_bytes), ready)
        across = c.activation_s * tokens / 2  # the down projection's input to the device
        device = c.fast_compute_s(tokens) * DOWN_SHARE * share
        return max(cpu_end, self.timeline.run("device", max(rows, gate_up + across), device))
