"""Adapter between the agent and engine anchors.

Uses the engine's native anchors (`session.anchor(kind, label)` / `session.rollback(anchor,
validate=...)`) when the session has them; for a session without them (a test double, another
backend) it keeps its own records and rolls back with `session.truncate(position)`, validating by
comparing token ids.
Either way it keeps each anchor's prefix token ids, so a failed validation is repaired by
re-prefilling that prefix into a fresh session ("rebuild").
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from freetoken_agents.engine import AnchorNotFoundError, AnchorValidationError

from .trace import AnchorKind

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AnchorHandle:
    """An anchor as the agent sees it: `position` tokens precede it."""

    id: str
    kind: AnchorKind
    position: int
    label: str | None = None
    prefix: tuple[int, ...] = field(default=(), repr=False)
    native: Any = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class RollbackOutcome:
    from_position: int
    to_position: int
    rebuilt: bool


class AnchorBook:
    """Places and rolls back to anchors on one session; keeps at most `max_anchors` (oldest
    non-system anchors are forgotten first) so memory stays bounded over long runs.

    The book owns the native anchors it places: one it forgets (evicted, cut off by a truncation or
    a rollback, or cleared) is discarded from the engine's store too, so a long-running agent
    releases the KV those anchors pinned instead of leaving it to the store's byte budget.
    """

    def __init__(self, max_anchors: int = 64, store: Any = None) -> None:
        self.max_anchors = max_anchors
        self.store = store  # the engine's AnchorStore, where native anchors live (None: not native)
        self._anchors: OrderedDict[str, AnchorHandle] = OrderedDict()
        self._ids = itertools.count(1)

    @property
    def native(self) -> bool:
        """Whether anchors are the engine's own (a store was given: FreeTokenModel's sessions), or
        positions in the text (ScriptedModel, OpenAICompatibleModel): declared, not probed."""
        return self.store is not None

    def place(self, session: Any, kind: AnchorKind, label: str | None = None) -> AnchorHandle:
        prefix = tuple(session.token_ids)
        if self.native:
            a = session.anchor(kind, label=label)
            handle = AnchorHandle(str(a.id), kind, int(a.position), label, prefix, a)
        else:
            handle = AnchorHandle(f"a{next(self._ids)}", kind, len(prefix), label, prefix)
        self._anchors[handle.id] = handle
        self._evict()
        return handle

    def rebind(self, session: Any, handle: AnchorHandle) -> AnchorHandle:
        """Re-anchor `handle` on `session`, whose context was rebuilt to exactly `handle.prefix`
        (after a failed validation). The book keeps `handle.id`, so the caller's handle stays
        valid; the returned handle carries the fresh native record. The old record is discarded."""
        if tuple(session.token_ids) != handle.prefix:
            raise ValueError(f"cannot rebind anchor {handle.id}: the session is not at its prefix")
        self._discard_native(handle)
        native = session.anchor(handle.kind, label=handle.label) if self.native else None
        fresh = AnchorHandle(handle.id, handle.kind, handle.position, handle.label, handle.prefix, native)
        self._anchors[handle.id] = fresh
        self._evict()
        return fresh

    def get(self, anchor_id: str) -> AnchorHandle | None:
        """The held handle with this id, or None."""
        return self._anchors.get(anchor_id)

    def forget_after(self, position: int) -> None:
        """Drop anchors past `position` (the context was cut below them)."""
        for key in [k for k, a in self._anchors.items() if a.position > position]:
            self._forget(key)

    def clear(self) -> None:
        """Forget every anchor (and discard the native ones from the engine's store)."""
        for key in list(self._anchors):
            self._forget(key)

    def __len__(self) -> int:
        return len(self._anchors)

    def __iter__(self) -> Iterator[AnchorHandle]:
        """Held anchors, oldest placed first."""
        return iter(list(self._anchors.values()))

    def __contains__(self, handle: AnchorHandle) -> bool:
        return handle.id in self._anchors

    def rollback(self, session: Any, handle: AnchorHandle, validate: str | None = None) -> bool:
        """Roll `session` back to `handle`. Returns False on success; True when validation failed
        and the caller must rebuild from `handle.prefix` (the session is left unchanged then).

        `validate` goes to the native `session.rollback(anchor, validate=...)` unchanged (the
        engine's modes); None leaves the engine's default. Non-native sessions compare token ids."""
        held = self._anchors.get(handle.id)
        if held is None:
            raise AnchorNotFoundError(f"anchor {handle.id} is not held (forgotten or past a truncation)")
        if held.native is not None and self.native:
            try:
                if validate is None:
                    session.rollback(held.native)
                else:
                    session.rollback(held.native, validate=validate)
            except (AnchorValidationError, AnchorNotFoundError) as e:
                logger.warning("anchor %s failed validation (%s); rebuilding by prefill", held.id, e)
                return True
        else:
            current = session.token_ids
            if len(current) < held.position or tuple(current[: held.position]) != held.prefix:
                logger.warning("anchor %s failed validation (prefix changed); rebuilding by prefill", held.id)
                return True
            session.truncate(held.position)
        self.forget_after(held.position)
        return False

    def _evict(self) -> None:
        while len(self._anchors) > self.max_anchors:
            victim = next((k for k, a in self._anchors.items() if a.kind != "system_prompt"), None)
            self._forget(victim if victim is not None else next(iter(self._anchors)))

    def _forget(self, key: str) -> None:
        self._discard_native(self._anchors.pop(key))

    def _discard_native(self, handle: AnchorHandle) -> None:
        if handle.native is not None and self.store is not None:
            self.store.discard(handle.native.id)
