"""TierState: what tier 1 holds, set and read as a whole.

Filled at load (`fill_fast`) or from a recorded routing (`warm_start`), recorded with an anchor and
re-warmed after a rollback (`snapshot_state`, `restore_state`), and the provider's `stats()`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..errors import EngineError
from ..ftw import FTWFile
from ..model.experts import ExpertKey
from .budget import MemoryBudget
from .graph_steps import GraphSteps
from .oracle import BandwidthOracle
from .planner import ExpertPlanner
from .policy import QStarPolicy
from .prefetch import Prefetcher
from .routing_trace import Step
from .stats import PhaseTimer
from .storage import BlockReader

logger = logging.getLogger(f"{__package__}.provider")  # its records under the provider's name


class TierState:
    """Tier 1's fill, warm start, snapshot and restore, and the stats of `TieredExpertProvider` (a
    mixin: its attributes are the provider's)."""

    ftw: FTWFile
    budget: MemoryBudget
    fast: Any
    host: Any
    moves: Any
    planner: ExpertPlanner
    policy: QStarPolicy
    prefetcher: Prefetcher | None
    reader: BlockReader
    phases: PhaseTimer
    storage_link: BandwidthOracle
    fast_link: BandwidthOracle
    act_link: BandwidthOracle | None
    graph_steps: GraphSteps | None
    exclusive: bool
    kv_bytes: int
    spare_bytes: int
    min_working_set: int
    _lock: Any  # the mover's lock (`TierMover.lock`)

    # ---- a warm start from a recorded routing ----------------------------------------------
    def warm_start(self, steps: Iterable[Step], *, progress: bool = False) -> int:
        """Start from a recorded routing of this model (`routing_trace.iter_steps` of a trace
        written by `record_routing`, streamed) instead of a cold tier 1: q*'s routing frequencies are seeded
        as if the engine had run those steps, tier 1 is filled with the most used experts that
        fit (read from tier 3 if tier 2 lacks them) and its hot set pinned. What llama.cpp's
        `-ot` asks a user to do by hand, from the same information; q* goes on adapting from
        there. Returns how many experts it brought into tier 1. RoutingTraceError (one line) for
        a step naming a layer or expert the model lacks; EngineError with placement "stream"
        (the per-layer LRU baseline keeps no frequencies)."""
        if not self.exclusive:
            raise EngineError("a routing profile warm-starts placement 'qstar' only, not 'stream'")
        name = Path(self.ftw.path).name
        keys = self.planner.warm_start(tqdm(steps, desc=f"profile {name}", unit="step", disable=not progress))
        self._promote_all(keys, f"warm {name}", progress)
        self.planner.refresh_hot()
        logger.info("warm start: %d experts in tier 1 from the routing profile", len(keys))
        return len(keys)

    def fill_fast(self, *, progress: bool = False) -> int:
        """Fill tier 1's free room now, before any routing is seen (`ExpertPlanner.load_fill`:
        an even share of every layer), as llama.cpp fills the GPU's layers at load: the first
        tokens then run from it instead of waiting for copies. q* replaces these experts as the
        routing shows what is used. Placement "stream" (the per-layer LRU baseline) starts
        empty. Returns how many experts it brought into tier 1."""
        if not self.exclusive:
            return 0
        keys = self.planner.load_fill()
        self._promote_all(keys, f"fill {Path(self.ftw.path).name}", progress)
        logger.info("tier 1 filled at load: %d experts", len(keys))
        return len(keys)

    def _promote_all(self, keys: list[ExpertKey], desc: str, progress: bool) -> None:
        """Bring `keys` into tier 1 in order (read from tier 3 where tier 2 lacks them)."""
        for key in tqdm(keys, desc=desc, unit="expert", disable=not progress):
            self.moves.promote(key, None)

    # ---- anchors: expert-cache state ------------------------------------------------------
    def snapshot_state(self) -> dict[str, list[ExpertKey]]:
        """Tier name -> experts held there, coldest first (an anchor records it with its KV)."""
        with self._lock:
            return {"fast": self.fast.keys(), "host": self.host.keys()}

    def restore_state(self, state: Mapping[str, Sequence[ExpertKey]]) -> None:
        """Re-warm tier 1 after a rollback: the anchor's tier-1 experts become the most recently
        used again (the tokens after the anchor route like the ones before it). Those that left
        tier 1 but are still in tier 2 are promoted; those that left RAM are not read back: a
        rollback never waits on the disk, and a demand read brings them in if they are needed."""
        for key in state.get("fast", ()):  # coldest first, so the hottest ends up most recent
            key = (int(key[0]), int(key[1]))
            with self._lock:
                if key in self.fast:
                    self.fast.get(key, count=False)
                    continue
                if key not in self.host:
                    continue
            self.moves.promote(key, None)

    # ---- observability --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Hits/misses per tier, bytes moved per link, bandwidth estimates (and their recent
        history), decisions, prefetch precision/recall, time per phase (s), budget figures
        (bytes). JSON-able: each part's own `stats()`, composed."""
        storage = self.reader.stats()
        links = (self.storage_link, self.fast_link, self.act_link)
        return {
            "tiers": {"fast": self.fast.stats(), "host": self.host.stats(), "storage": storage},
            "exclusive_ram_tiers": self.exclusive,
            "bytes_moved": self.moves.stats(),
            "file_bytes_read": storage["bytes_read"],
            "bandwidth": {link.name: link.stats() for link in links if link},
            "policy": self.policy.stats(),
            "prefetch": self.prefetcher.stats() if self.prefetcher else None,
            **self.phases.stats(),
            "budget": {
                "fast_bytes": self.budget.fast_bytes,
                "host_bytes": self.budget.host_bytes,
                "kv_bytes": self.kv_bytes,
                "spare_bytes": self.spare_bytes,
                "min_working_set": self.min_working_set,
            },
            "steps": self.planner.steps,
            "graph_steps": self.graph_steps.stats() if self.graph_steps is not None else None,
        }
