"""What a replay moves and counts: `VirtualMover`, the live `TierMover`'s bookkeeping with time
on a modelled machine instead of bytes, `warm` (tier 2 as a machine that has run the model a
while has it), and `Tally`, what the decode steps of a replay did (`replay.TieredReplay`, and the
baselines of `baselines`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..memory.fast_tier import FastTier
from ..memory.oracle import BandwidthOracle, ManualClock
from ..memory.tiers import HostTier
from ..model.experts import ExpertKey
from .machine import ExpertCosts, Timeline


@dataclass
class Tally:
    """What the decode steps of a replay did (totals; `PolicyResult` divides by tokens)."""

    tokens: int = 0
    seconds: float = 0.0
    fast_misses: int = 0
    host_misses: int = 0
    cpu_experts: int = 0
    bytes: Counter[str] = field(default_factory=Counter)
    decisions: Counter[str] = field(default_factory=Counter)


def warm(host: HostTier[Any], keys: Iterable[ExpertKey], nbytes: int) -> None:
    """Fill `host` with `keys` (each `nbytes`) in order while they fit: the RAM of a machine that
    has run the model for a while (a replay measures the steady state, not the first disk reads)."""
    for key in keys:
        if not host.has_room(nbytes, key):
            return
        host.put(key, True, nbytes)


class VirtualMover:
    """`TierMover`'s bookkeeping without bytes: reads, copies and decodes take time on `timeline`
    and are recorded by the same oracles; tiers change exactly as the live mover changes them."""

    def __init__(
        self,
        fast: FastTier[Any],
        host: HostTier[Any],
        costs: ExpertCosts,
        timeline: Timeline,
        links: tuple[BandwidthOracle, BandwidthOracle],
        clock: ManualClock,
        *,
        moves_up: set[ExpertKey],
        exclusive: bool,
    ) -> None:
        self.fast, self.host, self.costs, self.timeline = fast, host, costs, timeline
        self.exclusive = exclusive
        self.storage_link, self.fast_link = links
        self.clock, self.moves_up = clock, moves_up
        self.bytes: Counter[str] = Counter()
        self.now = 0.0  # when the running layer started (reads it issues start then)

    def _record(self, oracle: BandwidthOracle, nbytes: int, seconds: float) -> None:
        self.clock.now = max(self.clock.now, self.now)
        oracle.record(nbytes, seconds)

    def read(self, at: float) -> float:
        """Tier 3 -> tier 2: one block read; returns when it is in RAM."""
        c = self.costs
        self.bytes["storage->host"] += c.stored_bytes
        self._record(self.storage_link, c.stored_bytes, c.disk_s)
        return self.timeline.run("disk", at, c.disk_s)

    def host_value(self, key: ExpertKey, at: float, *, keep: bool = True) -> float:
        """When `key`'s tier-2 bytes are ready (a counted hit or miss; read and kept on a miss)."""
        if self.host.get(key) is not None:
            return at
        ready = self.read(at)
        if keep:
            self.host.put(key, True, self.costs.stored_bytes)
        return ready

    def promote(self, key: ExpertKey, at: float, staged: float | None) -> float:
        """Bring `key` into tier 1 (from a prefetch that arrived at `staged`, tier 2 or tier 3);
        returns when it is ready there."""
        c = self.costs
        moves_up = key in self.moves_up
        if staged is not None and c.device == "cuda":
            ready = staged  # the prefetch already copied it into the spare buffer
        else:
            # As the live mover: CUDA keeps what does not move up, a CPU what is not exclusive.
            keep = not moves_up if c.device == "cuda" else not self.exclusive
            host_ready = staged if staged is not None else self.host_value(key, at, keep=keep)
            s = c.promote_s(moves_up)  # CPU: a copy unless the block moves up
            ready = self.timeline.run("link", host_ready, s)
            self.bytes["host->fast"] += c.stored_bytes
            self._record(self.fast_link, c.stored_bytes, s)
        self.land(key)
        return ready

    def land(self, key: ExpertKey, *, recent: bool = False) -> None:
        """`key` is in tier 1 (its copy done; `recent`: a staged copy kept in the recent segment):
        the tiers change as the live mover changes them."""
        if key in self.moves_up:
            self.host.pop(key)
        elif key not in self.host:  # a decoded copy: the compact bytes stay in tier 2
            self.host.put(key, True, self.costs.stored_bytes)
        if recent:
            self.fast.put_recent(key, True, self.costs.fast_bytes)  # evictions: `on_fast_evict`
        else:
            self.fast.put(key, True, self.costs.fast_bytes)  # evictions: `on_fast_evict`

    def on_fast_evict(self, key: ExpertKey, _value: Any) -> None:
        """An expert whose bytes moved up goes back to tier 2 (CUDA: copied back over the link)."""
        if key not in self.moves_up:
            return
        if self.costs.device == "cuda":
            self.bytes["fast->host"] += self.costs.stored_bytes
        self.host.put(key, True, self.costs.stored_bytes)

    def prefetch_load(self, key: ExpertKey, *, stage: bool) -> float | None:
        """A prefetch: read `key` into tier 2 if absent; on CUDA with `stage` also copy it into the
        spare buffer. Returns when it is where a `take` finds it (CUDA without `stage`: None, a
        demand promote copies it from tier 2)."""
        c = self.costs
        ready = self.now
        if self.host.peek(key) is None:
            ready = self.read(self.now)
            if not (key in self.moves_up and key in self.fast):
                self.host.put(key, True, c.stored_bytes)
        if stage and c.device == "cuda":
            self.bytes["host->fast"] += c.stored_bytes
            self._record(self.fast_link, c.stored_bytes, c.link_s)
            return self.timeline.run("link", ready, c.link_s)
        return None if c.device == "cuda" else ready

    def copy_rows(self, nbytes: int, at: float) -> float:
        """A SPLIT's rows host -> device (not timed by the live engine: no oracle record)."""
        self.bytes["host->fast"] += nbytes
        return self.timeline.run("link", at, self.costs.rows_copy_s(nbytes))

    def warm_host(self, keys: Sequence[ExpertKey]) -> None:
        """Tier 2 as a machine that has run the model for a while has it (`warm`)."""
        warm(self.host, keys, self.costs.stored_bytes)
