"""`ExpertPlanner`: the tiered memory's decisions for a routed layer, apart from moving bytes.

Per step of a MoE layer it
- notes the routing (decayed frequency per expert; every `hot_every` steps the pinned hot set of
  tier 1 is re-evaluated from it),
- keeps which experts are needed soon: this layer's and the predictions for the coming ones
  (both tiers evict them last, so a prefetch never pushes out what the next layers use),
- for each routed expert not in tier 1, prices the case q* sees (`ExpertCase`: in tier 2 or not,
  prefetched or not, the victims a STREAM would evict and what keeping them is worth) and asks
  the policy for a `Placement`;
- on CUDA, where copies and host computations run beside the device, keeps when the link and the
  CPU will be free (each copy and host computation it decides or stages adds its predicted
  seconds), so q* spreads a layer's misses over both (and one miss: SPLIT), and a prefetch stages
  a copy only when the link can land it before the CPU could have computed the expert. When that
  layer starts is predicted layer by layer: the mean layer time, plus the CPU time of the misses
  predicted there beyond the mean number per layer (a layer whose experts are all in tier 1 takes
  a fraction of one with two host computations; a mean for every layer staged copies that landed
  late, wasting the link, and skipped ones that would have landed in time).

It never moves a byte. The live `TieredExpertProvider` carries its decisions out with `TierMover`
(real reads, decodes and copies); the simulator (`engine.simulate.replay`) with a virtual mover
on a virtual clock. Both hold the same tier classes, the same policy and this planner, so on the
same routing and the same measured costs they take the same decisions.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from ..model.experts import ExpertKey
from .fast_tier import FastTier
from .oracle import Clock
from .policy import DOWN_SHARE, ExpertCase, Placement, QStarPolicy
from .recent import RecentCopies
from .routing import RoutingFrequency
from .routing_trace import RoutingTraceError, Step
from .tiers import HostTier


class ExpertPlanner:
    """Decides where each routed expert computes, against the state of `fast` and `host`.

    Args:
        fast, host: tier 1 and tier 2 (what they hold; their `victims_for`, `fits`, `has_room`).
        policy: q* (or the always-stream baseline); its oracles price the links.
        routing: the decayed routing frequency shared with the tiers' eviction order.
        layers: the MoE layers in order (the first one counts the steps).
        stored_bytes, fast_bytes, codecs: per expert, its block size, tier-1 size and codec name.
        link_bytes: what a STREAM of an expert moves host -> fast.
        moves_up: CUDA, experts whose bytes move up whole (no device decode to price).
        device: the compute device type ("cpu" or "cuda"): the name compute is measured under.
        lock: the lock the tiers are changed under (loader threads insert into tier 2).
        clock: seconds, monotonic (the replay's virtual clock).
    """

    def __init__(
        self,
        *,
        fast: FastTier[Any],
        host: HostTier[Any],
        policy: QStarPolicy,
        routing: RoutingFrequency,
        layers: Sequence[int],
        stored_bytes: Mapping[ExpertKey, int],
        fast_bytes: Mapping[ExpertKey, int],
        codecs: Mapping[ExpertKey, str],
        link_bytes: Callable[[ExpertKey], int],
        moves_up: Collection[ExpertKey] = (),
        device: str = "cpu",
        lock: threading.RLock | None = None,
        hot_every: int = 16,
        clock: Clock = time.monotonic,
    ) -> None:
        self.fast, self.host, self.policy, self.routing = fast, host, policy, routing
        self.layers = list(layers)
        self.stored_bytes, self.fast_bytes, self.codecs = stored_bytes, fast_bytes, codecs
        self.link_bytes, self.moves_up = link_bytes, moves_up
        self.device, self.cuda = device, device == "cuda"
        self.lock = lock or threading.RLock()
        self.hot_every = hot_every
        self.steps = 0
        # MoE layer -> experts needed soon (its routed ones once it runs, predictions before).
        self.soon: dict[int, set[int]] = {}
        self.clock = clock
        self.link_free_at = self.host_free_at = 0.0  # CUDA: when the link / the CPU is free
        self.arrives: dict[ExpertKey, float] = {}  # CUDA: when a staged copy lands
        self.splits: dict[ExpertKey, float] = {}  # CUDA: a SPLIT's device share, until it runs
        self.room: int | None = None  # CUDA: staged copies that may wait at once (None: no cap)
        self.recent: RecentCopies | None = None  # CUDA: keeps staged copies a while (`keeps_staged`)
        self._biggest = max(fast_bytes, key=fast_bytes.__getitem__, default=None)  # a staging slot's size
        self.layer_s = 0.0  # CUDA: EMA of the time from one MoE layer's start to the next one's
        self.host_per_layer = 0.0  # CUDA: EMA of the host computations q* decides per layer
        self._last_start: float | None = None
        self._running = self.layers[0] if self.layers else 0  # the MoE layer that started last
        self._host_now = 0  # host computations decided for the running layer

    # ---- per step of a layer ----------------------------------------------------------------
    def note_routing(self, layer: int, used: Sequence[int]) -> None:
        """`layer` routes to `used` this step: count it; re-evaluate the hot set every
        `hot_every` steps (a step begins at the first MoE layer)."""
        self.routing.note(layer, used)
        if self.cuda:  # `layer_s` and `host_per_layer` serve `should_stage` only
            now = self.clock()
            if self._last_start is not None and now > self._last_start:
                gap = now - self._last_start
                self.layer_s = gap if not self.layer_s else 0.9 * self.layer_s + 0.1 * gap
                self.host_per_layer = 0.9 * self.host_per_layer + 0.1 * self._host_now
            self._last_start, self._running, self._host_now = now, layer, 0
        if layer == self.layers[0]:
            self.steps += 1
            if self.steps % self.hot_every == 0:
                self.refresh_hot()
            if self.recent is not None:
                with self.lock:
                    self.recent.step()

    def refresh_hot(self) -> None:
        """Pin tier 1's hottest experts (`FastTier.set_hot`)."""
        with self.lock:
            # Only tier 1's experts can be pinned: ranking every expert sorted 6,144 of them for
            # Qwen3-30B (2.6 ms every `hot_every` steps), twice what tier 1 holds.
            self.fast.set_hot(self.routing.hottest(self.fast.held()))  # any order: it sorts

    def warm_start(self, steps: Iterable[Step]) -> list[ExpertKey]:
        """Start from a recorded routing (`routing_trace.iter_steps` of a trace of this model,
        streamed: read once, never held whole): note every step's routing in layer order, as if the
        engine had run it. Returns what tier 1 should hold before the first token: the most used
        experts that fit its free room, coldest first (put in that order, the hottest end the most
        recently used). RoutingTraceError, in one line, for a step naming a layer or an expert this
        model does not have (the steps before it are noted: the caller discards the provider)."""
        moe = set(self.layers)
        for step in steps:
            for layer, routed in step.layers.items():
                if layer not in moe:
                    raise RoutingTraceError(
                        f"routing profile names layer {layer}, not a MoE layer of this model"
                    )
                for e in routed:
                    if (layer, e) not in self.fast_bytes:
                        raise RoutingTraceError(
                            f"routing profile names expert {e} of layer {layer}, "
                            "which this model does not have"
                        )
            for layer in self.layers:
                used = step.layers.get(layer)
                if used:
                    self.routing.note(layer, sorted(used))
        return self._fitting(self.routing.hottest())[::-1]

    def load_fill(self) -> list[ExpertKey]:
        """What tier 1 takes at load when no routing has been seen (no routing profile): an even
        share of every layer's experts, expert 0 of each layer, then expert 1, ..., while they
        fit its free room. Free fast memory is never better left empty: filled by demand copies
        instead, a cold tier 1 costs the first tokens their copies (Qwen3-30B-A3B on an RTX 4090
        at 50% of the expert bytes holds 3,048 experts, ~0.3 s of copies), and filled by
        copies of a long prompt's prefill it costs that prompt's first token. Which experts hardly
        matters: q* replaces them as the routing shows what is used."""
        width = max((e for _, e in self.fast_bytes), default=-1) + 1
        keys = [(layer, e) for e in range(width) for layer in self.layers]
        return self._fitting([k for k in keys if k in self.fast_bytes])

    def _fitting(self, keys: Iterable[ExpertKey]) -> list[ExpertKey]:
        """Those of `keys` not in tier 1 that its free room takes, in order (one that does not fit
        is passed over for smaller ones after it)."""
        room = self.fast.capacity_bytes
        free = None if room is None else room - self.fast.used_bytes
        chosen: list[ExpertKey] = []
        for key in keys:
            if key in self.fast:
                continue
            size = self.fast_bytes[key]
            if free is not None:
                if size > free:
                    continue
                free -= size
            chosen.append(key)
        return chosen

    def begin_layer(self, layer: int, used: Sequence[int]) -> None:
        """`layer` runs with `used`: they are needed now; the layers already run (all of them when
        a new step begins) are not needed any more, nor are the copies staged for them and never
        used (a wrong prediction: `starts_at` would count them as staged for the next step)."""
        first = layer == self.layers[0]
        with self.lock:
            for done in [lay for lay in self.soon if lay <= layer or first]:
                del self.soon[done]
            self.soon[layer] = set(used)
            for key in [k for k in self.arrives if k[0] < layer or (first and k[0] != layer)]:
                del self.arrives[key]

    def prefetch_has_work(self, in_ram: int) -> bool:
        """Whether a prefetch can bring anything closer, with `in_ram` experts in RAM (tier 1 or
        tier 2): not with every expert in tier 1, nor on a CPU-only machine with every expert in
        RAM (prefetch there reads tier 3 into tier 2 only, and a tier-1 miss computes from the
        tier-2 bytes where they are)."""
        total = len(self.stored_bytes)
        return len(self.fast) < total and (self.cuda or in_ram < total)

    def expect(self, layer: int, experts: Sequence[int]) -> None:
        """The prediction for a coming `layer`: its experts are needed soon."""
        with self.lock:
            self.soon[layer] = set(experts)

    def needed_soon(self, key: ExpertKey) -> bool:
        """Whether `key` is this layer's or predicted for a coming one (the tiers' `protected`)."""
        return key[1] in self.soon.get(key[0], ())

    def decide(self, key: ExpertKey, tokens: int, *, staged: bool, activation_bytes: int = 0) -> Placement:
        """The placement of `key`, not in tier 1, for `tokens` tokens (`staged`: a prefetch
        brought it; `activation_bytes`: what HOST compute moves). On CUDA the copy or the host
        computation it decides keeps the link or the CPU busy for the next decisions."""
        case = self.case(key, tokens, staged=staged, activation_bytes=activation_bytes)
        place = self.policy.decide(key, case)
        if self.cuda:
            share = self.policy.split_share(case) if place is Placement.SPLIT else 0.0
            with self.lock:
                self._book(key, place, staged, tokens, self.clock(), share)
        return place

    def keeps_staged(self, key: ExpertKey) -> bool:
        """STAGED: whether tier 1 keeps the staged copy of `key` just used in its recent segment
        (the caller puts it there: `FastTier.put_recent`) instead of letting it go (CUDA, once
        `recent` is set; never one whose bytes move up whole: kept, it would leave tier 2, and
        let go later it would cross the link again)."""
        if self.recent is None or key in self.moves_up:
            return False
        with self.lock:
            return self.recent.keep(key)

    def take_split(self, key: ExpertKey) -> float:
        """SPLIT: the share of `key`'s down projection rows the device computes (decided last)."""
        with self.lock:
            return self.splits.pop(key)

    def _book(
        self, key: ExpertKey, place: Placement, staged: bool, tokens: int, now: float, share: float = 0.0
    ) -> None:
        """The link or the CPU is busy with what was just decided for `key` (CUDA); a SPLIT's
        `share` of the down rows is the link's, the rest the CPU's."""
        self.arrives.pop(key, None)
        if place is Placement.STREAM and not staged:
            self.link_free_at = max(now, self.link_free_at) + self.copy_s(key)
        elif place in (Placement.HOST, Placement.SPLIT):
            self._host_now += key[0] == self._running
            compute = self.policy.compute.estimate(self.policy.host_device, self.codecs[key], tokens)
            self.host_free_at = max(now, self.host_free_at) + (1 - DOWN_SHARE * share) * compute
            if share:
                self.splits[key] = share
                rows = self.policy.host_fast.seconds_for(int(DOWN_SHARE * share * self.fast_bytes[key]))
                self.link_free_at = max(now, self.link_free_at) + rows

    def should_stage(self, key: ExpertKey) -> bool:
        """CUDA prefetch: whether to copy `key`, predicted for a coming layer, into the staging
        buffer now: the link lands it (after the copies already on it) before that layer's CPU
        could have computed it, the layer's start predicted by `starts_at`. Staged: the link is
        booked."""
        now = self.clock()
        compute = self.policy.compute.estimate(self.policy.host_device, self.codecs[key], 1)
        with self.lock:  # a loader thread asks while the compute thread decides
            if self.room is not None and len(self.arrives) >= self.room:
                return False  # the staging room is full of copies still waiting for their layer
            lands = max(now, self.link_free_at) + self.copy_s(key)
            if lands > self.starts_at(key[0], compute) + compute:
                return False
            self.link_free_at = lands
            self.arrives[key] = lands
        return True

    def staging_room(self, depth: int, top_k: int) -> int:
        """CUDA: how many staged copies wait at once, looking `depth` MoE layers ahead: the copies
        the link lands while that many layers run, plus one layer's `top_k` (predicted together);
        every predicted expert (`depth` x `top_k`) until a layer time is measured, and at most that.
        On the Mixtral / RTX 4090 / 50% replay 3 instead of 6 (tier 1 gets the other 3; 26.2 ->
        26.6 tok/s); one copy in flight instead of a layer's top-k starved Qwen3's fast copies."""
        most = depth * top_k
        if not self.layer_s or self._biggest is None:
            return most
        copy = self.copy_s(self._biggest)
        if not copy or not math.isfinite(copy):
            return most
        return max(1, min(most, math.ceil(depth * self.layer_s / copy) + top_k))

    def room_settled(self, room: int) -> bool:
        """Whether a staging room of `room` copies is near enough the current one to keep it: a
        refit reallocates tier 1's slot pool on a GPU (and its graphs are captured again), so a
        room wavering by one with the layer time must not move it."""
        current = self.room
        return current is not None and abs(room - current) <= max(1, current // 4)

    def starts_at(self, layer: int, host_s: float) -> float:
        """CUDA: when `layer` is predicted to start (clock seconds): from the running layer's start,
        each layer before it takes the mean layer time plus `host_s` for each expert predicted
        there (the routed ones for the running layer) that is neither in tier 1 nor staged, beyond
        the mean number of host computations per layer. A layer that already started: its start."""
        at = self.clock() if self._last_start is None else self._last_start
        i, end = self.layers.index(self._running), self.layers.index(layer)
        for lay in self.layers[i:end]:
            keys = [(lay, e) for e in self.soon.get(lay, ())]
            misses = sum(k not in self.fast and k not in self.arrives for k in keys)
            at += max(0.0, self.layer_s + (misses - self.host_per_layer) * host_s)
        return at

    # ---- pricing ----------------------------------------------------------------------------
    def case(self, key: ExpertKey, tokens: int, *, staged: bool, activation_bytes: int = 0) -> ExpertCase:
        """What q* needs to know about `key` now (`ExpertCase`); run for every tier-1 miss."""
        fast, size = self.fast, self.fast_bytes[key]
        with self.lock:
            resident = key in fast
            in_host = key in self.host
            hc = self.host.counters
            seen = hc.hits + hc.misses
            host_miss = hc.misses / seen if seen else 1.0
            victims = fast.victims_for(size, key) if not resident else []
        if self.cuda:
            now = self.clock()
            staged_wait = max(0.0, self.arrives.get(key, now) - now) if staged else 0.0
            link_wait, host_wait = max(0.0, self.link_free_at - now), max(0.0, self.host_free_at - now)
        else:
            staged_wait = link_wait = host_wait = 0.0
        of = self.routing.of
        return ExpertCase(
            tokens=tokens,
            codec=self.codecs[key],
            resident=resident,
            in_host=in_host or staged,
            stored_bytes=self.stored_bytes[key],
            link_bytes=self.link_bytes(key),
            decode_s=self.decode_s(key),
            fast_bytes=size,
            activation_bytes=activation_bytes,
            prefetched_s=float("inf") if staged and self.cuda else 0.0,
            frequency=of(key),
            victims=[(self.reload_s(v, host_miss), of(v)) for v in victims] if victims else (),
            host_miss=host_miss,
            can_stream=fast.fits(size, key),
            free_room=fast.has_room(size, key),
            staged=staged and self.cuda,
            staged_wait_s=staged_wait,
            link_wait_s=link_wait,
            host_wait_s=host_wait,
            can_split=self.cuda and not staged,
        )

    def decode_s(self, key: ExpertKey) -> float:
        """CUDA: measured seconds the device takes to decode `key`'s compact bytes (0 until
        measured, and for blocks that arrive in the compute dtype: their decode is a view)."""
        if not self.cuda or key in self.moves_up:
            return 0.0
        return self.policy.compute.measured(self.device, f"decode/{self.codecs[key]}", 1) or 0.0

    def copy_s(self, key: ExpertKey) -> float:
        """Predicted seconds of one copy of `key` into tier 1 (link and device decode)."""
        return self.policy.host_fast.seconds_for(self.link_bytes(key)) + self.decode_s(key)

    def reload_s(self, key: ExpertKey, host_miss: float) -> float:
        """Predicted seconds to bring `key` back into tier 1 after an eviction."""
        return self.copy_s(key) + host_miss * self.policy.storage.seconds_for(self.stored_bytes[key])
