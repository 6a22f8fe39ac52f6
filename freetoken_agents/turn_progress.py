"""What one model turn keeps across its retries: the text and the calls that stay.

A turn may call several tools. When call k fails in a way the model caused, the Agent rolls back
to the anchor placed just before call k, not to the turn's start: calls 0..k-1 ran, so their text
stays in the context and their records (with results) stay in the step; they are never executed
again. When the format puts several calls behind one marker (one anchor for all of them), the
rollback lands before completed calls too; those are kept aside and, if the model writes an
identical call again (same name and arguments), its recorded result is reused instead of running
the tool a second time.

Offsets are character indices in the text the model wrote in the turn: the text kept from
earlier attempts, then the latest attempt's. The failure notes, though in the context between
them, are not part of it: a note may quote a broken call, which a parser must never see.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .anchors import AnchorHandle
from .trace import ToolCallRecord


@dataclass(frozen=True)
class RollbackPlan:
    """Where a retry goes back to. anchor None: the turn's start (re-sync the messages)."""

    anchor: AnchorHandle | None
    offset: int  # turn-text offset of that point
    renote: bool  # the notes after it were rolled back over: append them again before the new one


@dataclass
class TurnProgress:
    """The state of one model turn across attempts (see the module docstring)."""

    kept_text: str = ""  # model-written turn text before `base`, kept in the context by rollbacks
    base: AnchorHandle | None = None  # where the latest rollback went (None: the turn's start)
    notes: list[str] = field(default_factory=list)  # failure notes appended after `base`
    all_notes: list[str] = field(default_factory=list)  # every note of the turn, in order
    kept_calls: list[ToolCallRecord] = field(default_factory=list)  # completed calls before `base`
    redo: list[ToolCallRecord] = field(default_factory=list)  # completed calls rolled back over
    # The latest attempt: the model-written turn text after it, its tool-call anchors and completed calls
    # (turn-text offset first), and where its failing (or unterminated) call starts.
    full_text: str = ""
    anchors: list[tuple[int, AnchorHandle]] = field(default_factory=list)
    done: list[tuple[int, ToolCallRecord]] = field(default_factory=list)
    failed_at: int | None = None

    def start_attempt(self) -> None:
        self.anchors, self.done, self.failed_at = [], [], None

    def take_redo(self, name: str, arguments: Any) -> ToolCallRecord | None:
        """A completed call identical to (name, arguments), removed from the rolled-back ones."""
        for i, record in enumerate(self.redo):
            if record.tool == name and record.arguments == arguments:
                return self.redo.pop(i)
        return None

    def plan_rollback(self) -> RollbackPlan:
        """The latest anchor of the attempt at or before the failure; else the current base."""
        if self.failed_at is not None:
            before = [(o, a) for o, a in self.anchors if o <= self.failed_at]
            if before:
                offset, anchor = before[-1]
                return RollbackPlan(anchor, offset, renote=False)
        return RollbackPlan(self.base, len(self.kept_text), renote=True)

    def rolled_back(self, plan: RollbackPlan, note: str) -> None:
        """Record a rollback to `plan` from the latest attempt, and the note appended after it."""
        for offset, record in self.done:
            (self.kept_calls if offset < plan.offset else self.redo).append(record)
        if not plan.renote:
            self.kept_text, self.base, self.notes = self.full_text[: plan.offset], plan.anchor, []
        self.notes.append(note)
        self.all_notes.append(note)
