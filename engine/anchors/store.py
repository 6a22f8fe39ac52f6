"""`AnchorStore`: the engine's anchors by id, with an LRU byte budget, pins, and save/load.

Byte budget: what anchors cost is the KV they keep alive that no session uses. `used_bytes` counts
the blocks held *only* by anchors (a block whose refcount equals the number of anchors holding
it), times the block size in bytes. Blocks shared with a live session are free to keep; so are
twenty anchors along one branch, which share every block with each other and the session.
The budget is enforced when an anchor is added (never evicting the one just added), when the
budget is set, when a session releases blocks (close, truncate, rollback: its blocks may become
anchor-only), on `enforce_budget()`, and whenever the KV pool runs full (`reclaim`, which the
engine installs as the pool's hook).

The default budget (`byte_budget="auto"`, `default_byte_budget`) scales with the model: half the
engine's KV budget when one is set (`MemoryBudget(kv_bytes=...)`; a full pool also reclaims cold
anchors, so sessions can always take the other half back), else the KV of four full contexts, at
most 256 MiB (the pool has no ceiling then: without a budget, anchors on abandoned branches would
keep their blocks forever). Measured on the embedded model (1,024-token context, 48 KiB blocks),
2,000 anchors each on a branch of its own pin 2,000 partial blocks: +98 MB of KV unbounded
(+110 MB RSS); the default keeps 12.6 MB. `None` means unbounded.

Records cost memory too, whatever KV they share: `metadata_bytes` estimates them (8 bytes per
token id, a fixed overhead per record; the expert-cache state, often the largest part on a big
model, is stored once per distinct state and shared by every anchor that has it), and
`metadata_budget` (default 64 MiB) bounds them the same way, least recently used first.

Eviction order is least recently used: `get` (and a rollback, which goes through it) and
re-anchoring an identical state refresh an anchor. Pinned anchors are never evicted, but they
count towards `used_bytes`.

Thread safety: every public method holds the engine's lock (`AnchorHost.lock`, re-entrant;
sessions hold it for their steps), so the store may be used from any thread.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from ..errors import AnchorNotFoundError
from ..model.kv import BlockTable
from .anchor import Anchor, ExpertState, check_kind, identify, make_anchor
from .host import AnchorHost

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_KV_SHARE = 0.5  # of the engine's KV budget, when it has one (a full pool reclaims the rest)
DEFAULT_CONTEXTS = 4  # full contexts of KV, when the engine has no KV budget
DEFAULT_BYTE_CAP = 256 * 2**20
DEFAULT_METADATA_BUDGET = 64 * 2**20
RECORD_OVERHEAD = 1536  # bytes of one record besides its token ids (digests, signature, table, ...)


def default_byte_budget(host: AnchorHost) -> int:
    """The anchor store's default byte budget on `host` (see the module docstring)."""
    if host.kv_bytes is not None:
        return int(host.kv_bytes * DEFAULT_KV_SHARE)
    pool = host.pool
    context_blocks = -(-host.max_context // pool.block_size)
    return min(DEFAULT_CONTEXTS * context_blocks * pool.bytes_per_block, DEFAULT_BYTE_CAP)


def _locked(method: Callable[..., T]) -> Callable[..., T]:
    """Run a store method under the engine's lock."""

    @functools.wraps(method)
    def locked(self: AnchorStore, *args: Any, **kwargs: Any) -> T:
        with self.host.lock:
            return method(self, *args, **kwargs)

    return locked


class AnchorStore:
    """All anchors of one engine. Created by the Engine (`engine.anchors`); thread-safe."""

    def __init__(
        self,
        host: AnchorHost,
        *,
        byte_budget: int | None | Literal["auto"] = "auto",
        metadata_budget: int | None = DEFAULT_METADATA_BUDGET,
        key_file: str | os.PathLike[str] | None = None,
    ) -> None:
        """`byte_budget`: bytes of anchor-only KV to keep ("auto": `default_byte_budget`; None:
        unbounded).
        `metadata_budget`: estimated bytes of anchor records to keep (None: unbounded).
        `key_file`: the anchor key that authenticates saved anchors (`keys.key_path`: default
        $FREETOKEN_ANCHOR_KEY_FILE, $FREETOKEN_CONFIG_DIR/anchor.key, else the user config dir);
        read (and on first save created) only when anchors are saved or loaded."""
        if byte_budget != "auto":
            _check_budget("byte_budget", byte_budget)
        _check_budget("metadata_budget", metadata_budget)
        self.host = host
        self.key_file = key_file
        self._anchors: OrderedDict[str, Anchor] = OrderedDict()  # LRU order: oldest first
        self._pinned: set[str] = set()
        self._byte_budget = byte_budget
        self._metadata_budget = metadata_budget
        self._holders: Counter[int] = Counter()  # block -> stored anchors holding it
        self._claims: Counter[str] = Counter()  # anchor id -> creates not yet discarded
        # each distinct expert state once: -> (the one stored object, anchors that have it)
        self._states: dict[ExpertState, tuple[ExpertState, int]] = {}
        self._metadata_bytes = 0
        self.evictions = 0

    # ---- budget -------------------------------------------------------------------------------
    @property
    def byte_budget(self) -> int | None:
        """Most bytes of anchor-only KV blocks to keep (None: unbounded). Setting it enforces it."""
        if self._byte_budget == "auto":
            self._byte_budget = default_byte_budget(self.host)
        return self._byte_budget

    @byte_budget.setter
    def byte_budget(self, value: int | None) -> None:
        _check_budget("byte_budget", value)
        self._byte_budget = value
        self.enforce_budget()

    @property
    def metadata_budget(self) -> int | None:
        """Most estimated bytes of anchor records to keep (None: unbounded). Setting it enforces it."""
        return self._metadata_budget

    @metadata_budget.setter
    def metadata_budget(self, value: int | None) -> None:
        _check_budget("metadata_budget", value)
        self._metadata_budget = value
        self.enforce_budget()

    @property
    @_locked
    def used_bytes(self) -> int:
        """Bytes of KV blocks that only anchors keep alive (see the module docstring)."""
        pool = self.host.pool
        return sum(1 for b, n in self._holders.items() if pool.refcount[b] == n) * pool.bytes_per_block

    @property
    def metadata_bytes(self) -> int:
        """Estimated bytes of the stored records (see the module docstring)."""
        return self._metadata_bytes

    @_locked
    def exclusive_bytes(self, anchor_id: str) -> int:
        """Bytes of the blocks this anchor alone keeps alive (what discarding it would free)."""
        anchor = self._require(anchor_id)
        pool = self.host.pool
        return sum(1 for b in set(anchor.table.blocks) if pool.refcount[b] == 1) * pool.bytes_per_block

    @_locked
    def enforce_budget(self, *, keep: str | None = None) -> list[str]:
        """Evict least recently used unpinned anchors (never `keep`) until within both budgets.

        Returns the evicted ids.
        """
        evicted: list[str] = []
        while (reason := self._over_budget()) is not None:
            victim = self._coldest(keep)
            if victim is None:
                break
            self._drop(victim, reason=reason)
            evicted.append(victim)
        return evicted

    def _over_budget(self) -> str | None:
        """Which budget the store is over ("metadata budget", "byte budget"), if any."""
        if self._metadata_budget is not None and self._metadata_bytes > self._metadata_budget:
            return "metadata budget"
        budget = self.byte_budget
        if budget is not None and self.used_bytes > budget:
            return "byte budget"
        return None

    @_locked
    def reclaim(self) -> bool:
        """Pool hook: evict the least recently used unpinned anchor; False when none is left."""
        victim = self._coldest(None)
        if victim is None:
            return False
        self._drop(victim, reason="KV pool full")
        return True

    # ---- creating and finding -----------------------------------------------------------------
    @_locked
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
        already stored (same id) is refreshed and returned instead of a second record; it then has
        one more claim (see `discard`)."""
        check_kind(kind)
        fingerprint = self.host.model_fingerprint
        state = self.host.expert_state()
        state = self._states.get(state, (state, 0))[0]  # a state already stored: that one object
        identity = identify(table, token_ids, fingerprint, state)
        existing = self._anchors.get(identity[0])
        if existing is not None:
            self._anchors.move_to_end(existing.id)
            self._claims[existing.id] += 1
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
        self._add(anchor)
        logger.debug("anchor %s (%s) at %d tokens", anchor.id[:12], kind, anchor.position)
        self.enforce_budget(keep=anchor.id)
        return anchor

    @_locked
    def get(self, anchor_id: str) -> Anchor:
        """The anchor with this id (marks it recently used); AnchorNotFoundError if absent."""
        anchor = self._require(anchor_id)
        self._anchors.move_to_end(anchor_id)
        return anchor

    @_locked
    def peek(self, anchor_id: str) -> Anchor | None:
        """The anchor with this id, or None; does not touch the LRU order."""
        return self._anchors.get(anchor_id)

    def __contains__(self, anchor_id: object) -> bool:
        return anchor_id in self._anchors

    def __len__(self) -> int:
        return len(self._anchors)

    @_locked
    def __iter__(self) -> Iterator[Anchor]:
        """Anchors from least to most recently used."""
        return iter(list(self._anchors.values()))

    @_locked
    def list_by(self, *, session_id: str | None = None, kind: str | None = None) -> list[Anchor]:
        """Anchors (optionally of one session and/or kind), oldest created first."""
        found = [
            a
            for a in self._anchors.values()
            if (session_id is None or a.session_id == session_id) and (kind is None or a.kind == kind)
        ]
        return sorted(found, key=lambda a: a.created)

    @_locked
    def lineage(self, anchor: Anchor) -> list[tuple[int, str]]:
        """(position, id) of the anchor and its stored ancestors, root first."""
        chain: list[tuple[int, str]] = []
        current: Anchor | None = anchor
        while current is not None and len(chain) <= len(self._anchors):
            chain.append((current.position, current.id))
            current = self._anchors.get(current.parent_id) if current.parent_id else None
        return chain[::-1]

    # ---- pins and removal ---------------------------------------------------------------------
    @_locked
    def pin(self, anchor_id: str) -> None:
        """Exempt the anchor from eviction (it still counts towards `used_bytes`)."""
        self._require(anchor_id)
        self._pinned.add(anchor_id)

    @_locked
    def unpin(self, anchor_id: str) -> None:
        self._pinned.discard(anchor_id)

    def is_pinned(self, anchor_id: str) -> bool:
        return anchor_id in self._pinned

    @_locked
    def discard(self, anchor_id: str) -> bool:
        """Release one claim on the anchor: each `create` of its state made one (two holders, say a
        context's anchors and a prefix cache, may anchor the same content-addressed state). The
        last claim removes it and releases its blocks (pinned or not). False if it was not stored."""
        if anchor_id not in self._anchors:
            return False
        self._claims[anchor_id] -= 1
        if self._claims[anchor_id] <= 0:
            self._drop(anchor_id, reason="discarded")
        return True

    @_locked
    def clear(self) -> None:
        """Remove every anchor, pinned ones included."""
        for anchor_id in list(self._anchors):
            self._drop(anchor_id, reason="cleared")

    # ---- persistence --------------------------------------------------------------------------
    @_locked
    def save(self, path: str | Path, ids: Sequence[str] | None = None) -> Path:
        """Write the anchors (all, or `ids`) to folder `path`, authenticated with this user's anchor
        key; see `persist.save_anchors`."""
        from .persist import save_anchors

        anchors = [self._require(i) for i in ids] if ids is not None else list(self._anchors.values())
        return save_anchors(self.host, anchors, Path(path), pinned=self._pinned, key_file=self.key_file)

    @_locked
    def load(self, path: str | Path) -> list[Anchor]:
        """Read anchors saved by `save` into this engine's store; see `persist.load_anchors`.

        Returns the loaded anchors (ones already stored are returned as stored). Raises
        AnchorFileError (also for a folder not authenticated with this user's anchor key),
        AnchorFingerprintError or AnchorValidationError; then nothing is loaded.
        """
        from .persist import load_anchors

        loaded, pinned = load_anchors(self.host, Path(path), key_file=self.key_file)
        out: list[Anchor] = []
        for anchor in loaded:
            existing = self._anchors.get(anchor.id)
            if existing is not None:
                anchor.table.release()
                out.append(existing)
                continue
            anchor = self._add(anchor)
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

    def _add(self, anchor: Anchor) -> Anchor:
        """Store `anchor` (its expert state shared with the stored anchors that have the same);
        returns the stored record."""
        state, count = self._states.get(anchor.expert_state, (anchor.expert_state, 0))
        if state is not anchor.expert_state:
            anchor = dataclasses.replace(anchor, expert_state=state)
        self._states[state] = (state, count + 1)
        self._anchors[anchor.id] = anchor
        self._claims[anchor.id] = 1
        self._holders.update(set(anchor.table.blocks))
        self._metadata_bytes += _record_bytes(anchor)
        return anchor

    def _drop(self, anchor_id: str, *, reason: str) -> None:
        anchor = self._anchors.pop(anchor_id)
        del self._claims[anchor_id]
        self._pinned.discard(anchor_id)
        self._holders.subtract(set(anchor.table.blocks))
        for block in set(anchor.table.blocks):
            if self._holders[block] <= 0:
                del self._holders[block]
        self._metadata_bytes -= _record_bytes(anchor)
        state, count = self._states[anchor.expert_state]
        if count > 1:
            self._states[state] = (state, count - 1)
        else:
            del self._states[state]
        anchor.table.release()
        if reason in ("byte budget", "metadata budget", "KV pool full"):
            self.evictions += 1
        logger.debug("anchor %s dropped (%s)", anchor_id[:12], reason)


def _check_budget(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be a number of bytes >= 0 or None, got {value!r}")


def _record_bytes(anchor: Anchor) -> int:
    """Estimated bytes of one record besides its shared expert state: 8 per token id (a tuple of
    references) plus a fixed overhead."""
    return 8 * len(anchor.token_ids) + RECORD_OVERHEAD
