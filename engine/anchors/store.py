"""`AnchorStore`: the engine's anchors by id, with an LRU byte budget, pins, and save/load.

Byte budget: what anchors cost is the KV they keep alive that no session uses. `used_bytes` counts
the blocks held *only* by anchors (a block whose refcount equals the number of anchors holding
it), times the block size in bytes. Blocks shared with a live session are free to keep; so are
twenty anchors along one branch, which share every block with each other and the session.
The budget is enforced when an anchor is added (never evicting the one just added), when the
budget is set, when a session releases blocks (close, truncate, rollback: its blocks may become
anchor-only), on `enforce_budget()`, and whenever the KV pool runs full (`reclaim`, which the
engine installs as the pool's hook).

Eviction order is least recently used: `get` (and a rollback, which goes through it) and
re-anchoring an identical state refresh an anchor. Pinned anchors are never evicted, but they
count towards `used_bytes`.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import AnchorNotFoundError
from ..kv import BlockTable
from .anchor import Anchor, check_kind, identify, make_anchor, snapshot_expert_state

if TYPE_CHECKING:
    from ..engine import Engine

logger = logging.getLogger(__name__)


class AnchorStore:
    """All anchors of one engine. Created by the Engine (`engine.anchors`); not thread-safe."""

    def __init__(
        self,
        engine: Engine,
        *,
        byte_budget: int | None = None,
        key_file: str | os.PathLike[str] | None = None,
    ) -> None:
        """`key_file`: the anchor key that authenticates saved anchors (`keys.key_path`: default
        $FREETOKEN_ANCHOR_KEY_FILE, $FREETOKEN_CONFIG_DIR/anchor.key, else the user config dir);
        read (and on first save created) only when anchors are saved or loaded."""
        self.engine = engine
        self.key_file = key_file
        self._anchors: OrderedDict[str, Anchor] = OrderedDict()  # LRU order: oldest first
        self._pinned: set[str] = set()
        self._byte_budget = byte_budget
        self.evictions = 0

    # ---- budget -------------------------------------------------------------------------------
    @property
    def byte_budget(self) -> int | None:
        """Most bytes of anchor-only KV blocks to keep (None: unbounded). Setting it enforces it."""
        return self._byte_budget

    @byte_budget.setter
    def byte_budget(self, value: int | None) -> None:
        if value is not None and value < 0:
            raise ValueError(f"byte_budget must be >= 0 or None, got {value}")
        self._byte_budget = value
        self.enforce_budget()

    @property
    def used_bytes(self) -> int:
        """Bytes of KV blocks that only anchors keep alive (see the module docstring)."""
        pool = self.engine.kv_pool
        holders = Counter(b for a in self._anchors.values() for b in a.table.blocks)
        return sum(1 for b, n in holders.items() if pool.refcount[b] == n) * pool.bytes_per_block

    def exclusive_bytes(self, anchor_id: str) -> int:
        """Bytes of the blocks this anchor alone keeps alive (what discarding it would free)."""
        anchor = self._require(anchor_id)
        pool = self.engine.kv_pool
        return sum(1 for b in set(anchor.table.blocks) if pool.refcount[b] == 1) * pool.bytes_per_block

    def enforce_budget(self, *, keep: str | None = None) -> list[str]:
        """Evict least recently used unpinned anchors (never `keep`) until within the budget.

        Returns the evicted ids.
        """
        evicted: list[str] = []
        if self._byte_budget is None:
            return evicted
        while self.used_bytes > self._byte_budget:
            victim = self._coldest(keep)
            if victim is None:
                break
            self._drop(victim, reason="byte budget")
            evicted.append(victim)
        return evicted

    def reclaim(self) -> bool:
        """Pool hook: evict the least recently used unpinned anchor; False when none is left."""
        victim = self._coldest(None)
        if victim is None:
            return False
        self._drop(victim, reason="KV pool full")
        return True

    # ---- creating and finding -----------------------------------------------------------------
    def create(
        self,
        table: BlockTable,
        token_ids: Sequence[int],
        *,
        kind: str,
        label: str | None = None,
        parent_id: str | None = None,
        session_id: str = "",
    ) -> Anchor:
        """Anchor `table` + `token_ids` (Session.anchor calls this). An identical state that is
        already stored (same id) is refreshed and returned instead of a second record."""
        check_kind(kind)
        engine = self.engine
        fingerprint = engine.model_fingerprint
        state = snapshot_expert_state(engine.experts)
        identity = identify(table, token_ids, fingerprint, state)
        existing = self._anchors.get(identity[0])
        if existing is not None:
            self._anchors.move_to_end(existing.id)
            return existing
        anchor = make_anchor(
            table,
            token_ids,
            identity,
            kind=kind,
            label=label,
            parent_id=parent_id,
            session_id=session_id,
            fingerprint=fingerprint,
            expert_state=state,
        )
        self._anchors[anchor.id] = anchor
        logger.debug("anchor %s (%s) at %d tokens", anchor.id[:12], kind, anchor.position)
        self.enforce_budget(keep=anchor.id)
        return anchor

    def get(self, anchor_id: str) -> Anchor:
        """The anchor with this id (marks it recently used); AnchorNotFoundError if absent."""
        anchor = self._require(anchor_id)
        self._anchors.move_to_end(anchor_id)
        return anchor

    def peek(self, anchor_id: str) -> Anchor | None:
        """The anchor with this id, or None; does not touch the LRU order."""
        return self._anchors.get(anchor_id)

    def __contains__(self, anchor_id: object) -> bool:
        return anchor_id in self._anchors

    def __len__(self) -> int:
        return len(self._anchors)

    def __iter__(self) -> Iterator[Anchor]:
        """Anchors from least to most recently used."""
        return iter(list(self._anchors.values()))

    def list_by(self, *, session_id: str | None = None, kind: str | None = None) -> list[Anchor]:
        """Anchors (optionally of one session and/or kind), oldest created first."""
        found = [
            a
            for a in self._anchors.values()
            if (session_id is None or a.session_id == session_id) and (kind is None or a.kind == kind)
        ]
        return sorted(found, key=lambda a: a.created)

    def lineage(self, anchor: Anchor) -> list[tuple[int, str]]:
        """(position, id) of the anchor and its stored ancestors, root first."""
        chain: list[tuple[int, str]] = []
        current: Anchor | None = anchor
        while current is not None and len(chain) <= len(self._anchors):
            chain.append((current.position, current.id))
            current = self._anchors.get(current.parent_id) if current.parent_id else None
        return chain[::-1]

    # ---- pins and removal ---------------------------------------------------------------------
    def pin(self, anchor_id: str) -> None:
        """Exempt the anchor from eviction (it still counts towards `used_bytes`)."""
        self._require(anchor_id)
        self._pinned.add(anchor_id)

    def unpin(self, anchor_id: str) -> None:
        self._pinned.discard(anchor_id)

    def is_pinned(self, anchor_id: str) -> bool:
        return anchor_id in self._pinned

    def discard(self, anchor_id: str) -> bool:
        """Remove the anchor and release its blocks (pinned or not); False if it was not stored."""
        if anchor_id not in self._anchors:
            return False
        self._drop(anchor_id, reason="discarded")
        return True

    def clear(self) -> None:
        """Remove every anchor, pinned ones included."""
        for anchor_id in list(self._anchors):
            self._drop(anchor_id, reason="cleared")

    # ---- persistence --------------------------------------------------------------------------
    def save(self, path: str | Path, ids: Sequence[str] | None = None) -> Path:
        """Write the anchors (all, or `ids`) to folder `path`, authenticated with this user's anchor
        key; see `persist.save_anchors`."""
        from .persist import save_anchors

        anchors = [self._require(i) for i in ids] if ids is not None else list(self._anchors.values())
        return save_anchors(self.engine, anchors, Path(path), pinned=self._pinned, key_file=self.key_file)

    def load(self, path: str | Path) -> list[Anchor]:
        """Read anchors saved by `save` into this engine's store; see `persist.load_anchors`.

        Returns the loaded anchors (ones already stored are returned as stored). Raises
        AnchorFileError (also for a folder not authenticated with this user's anchor key),
        AnchorFingerprintError or AnchorValidationError; then nothing is loaded.
        """
        from .persist import load_anchors

        loaded, pinned = load_anchors(self.engine, Path(path), key_file=self.key_file)
        out: list[Anchor] = []
        for anchor in loaded:
            existing = self._anchors.get(anchor.id)
            if existing is not None:
                anchor.table.release()
                out.append(existing)
                continue
            self._anchors[anchor.id] = anchor
            if anchor.id in pinned:
                self._pinned.add(anchor.id)
            out.append(anchor)
        self.enforce_budget()
        return out

    # ---- internals ----------------------------------------------------------------------------
    def _require(self, anchor_id: str) -> Anchor:
        anchor = self._anchors.get(anchor_id)
        if anchor is None:
            raise AnchorNotFoundError(
                f"no anchor {anchor_id!r} in this engine's store (never created here, evicted, or "
                f"discarded); rebuild the state by prefill from its token ids"
            )
        return anchor

    def _coldest(self, keep: str | None) -> str | None:
        for anchor_id in self._anchors:
            if anchor_id != keep and anchor_id not in self._pinned:
                return anchor_id
        return None

    def _drop(self, anchor_id: str, *, reason: str) -> None:
        anchor = self._anchors.pop(anchor_id)
        self._pinned.discard(anchor_id)
        anchor.table.release()
        if reason in ("byte budget", "KV pool full"):
            self.evictions += 1
        logger.debug("anchor %s dropped (%s)", anchor_id[:12], reason)
