"""Human-readable output of the recipes and the demo: streamed model text (indented, with the
anchors printed where they sit), tool calls, retries, rollbacks and one-line summaries.

Everything goes through a `Write` function (the CLI passes stdout's), never `print`."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from freetoken_agents.trace import AnchorRecord, RollbackRecord, Trace

from ._common import Write

if TYPE_CHECKING:
    from freetoken_agents import AgentEvent

    from .coding_solver import CodingEvent


class _Block:
    """Model text streamed as an indented block; other lines may interrupt it."""

    def __init__(self, write: Write, indent: str = "    | ") -> None:
        self.write, self.indent = write, indent
        self.line_start = True

    def text(self, text: str) -> None:
        for piece in text.splitlines(keepends=True):
            if self.line_start:
                self.write(self.indent)
            self.write(piece)
            self.line_start = piece.endswith("\n")

    def end(self) -> None:
        """End the block's current line, if one is open."""
        if not self.line_start:
            self.write("\n")
            self.line_start = True

    def line(self, text: str) -> None:
        """A line of our own, on a line of its own."""
        self.end()
        self.write(text + "\n")


def anchor_line(record: AnchorRecord) -> str:
    label = f" '{record.label}'" if record.label else ""
    return f"    [anchor {record.id[:8]}: {record.kind}{label} at token {record.position}]"


def rollback_line(record: RollbackRecord) -> str:
    rebuilt = ", rebuilt by prefill" if record.rebuilt else ""
    return (
        f"  rollback to anchor {record.anchor_id[:8]}: position {record.from_position} -> "
        f"{record.to_position} ({record.tokens_saved} tokens kept, {record.tokens_discarded} "
        f"discarded{rebuilt})"
    )


class CodingPrinter:
    """Prints `solve`'s events: each attempt's text with its anchors, the test outcome, the
    rollback and the note."""

    def __init__(self, write: Write) -> None:
        self.out = _Block(write)

    def __call__(self, event: CodingEvent) -> None:
        out, data = self.out, event.data
        if event.kind == "start":
            how = "greedy"
            if data["seed"] is not None:
                how = f"sampled: temperature {data['temperature']:g}, seed {data['seed']}"
            out.line(f"{'retry: ' if event.attempt > 1 else ''}attempt {event.attempt} ({how})")
        elif event.kind == "text":
            out.text(data)
        elif event.kind == "anchor":
            out.line(anchor_line(data))
        elif event.kind == "attempt":
            out.line("  PASSED: every test holds" if data.passed else f"  FAILED: {data.error}")
        elif event.kind == "rollback":
            out.line(rollback_line(data))
        elif event.kind == "note":
            out.line(f"  note appended: {data.strip()}")


class AgentPrinter:
    """Prints an Agent's events: a header per step, streamed text, anchors, calls, retries,
    rollbacks, results and the final answer."""

    def __init__(self, write: Write) -> None:
        self.out = _Block(write)
        self.step = 0

    def __call__(self, event: AgentEvent) -> None:
        out, data = self.out, event.data
        if event.step != self.step and event.kind != "final":
            self.step = event.step
            out.line(f"step {event.step}")
        if event.kind == "text":
            out.text(data)
        elif event.kind == "anchor":
            out.line(anchor_line(data))
        elif event.kind == "tool_call":
            out.line(f"  call {data['tool']}({_args(data['arguments'])})")
        elif event.kind == "retry":
            if data.scope == "tool":
                out.line(f"  {data.tool} failed ({data.error_type}: {data.error}): retrying the tool")
            else:
                out.line(f"  the model's turn failed ({data.error_type}: {data.error}): rolling back")
        elif event.kind == "rollback":
            out.line(rollback_line(data))
        elif event.kind == "tool_result":
            out.line(f"  result of {data.tool}: {_short(data.result)} ({data.seconds:.2f} s)")
        elif event.kind == "final":
            out.line(f"final answer: {data.output.strip() or '(empty)'}")


def answer_block(write: Write, title: str, text: str) -> None:
    """`title`, then `text` as an indented block."""
    write(title + "\n")
    block = _Block(write)
    block.text(text or "(empty)")
    block.end()


def trace_summary(trace: Trace) -> str:
    """One line: steps, calls, anchors by kind, retries by scope, rollbacks and token counts."""
    anchors = Counter(a.kind for a in trace.anchors)
    retries = Counter(r.scope for r in trace.retries)
    kinds = ", ".join(f"{k} {n}" for k, n in anchors.items()) or "none"
    return (
        f"trace: {len(trace.steps)} steps, {len(trace.tool_calls)} tool calls; anchors: {kinds}; "
        f"retries: tool {retries['tool']}, model {retries['model']}; rollbacks {len(trace.rollbacks)}; "
        f"tokens: prefilled {trace.tokens_prefilled}, decoded {trace.tokens_decoded}, reused "
        f"{trace.tokens_reused}, kept by rollback {trace.tokens_saved_by_rollback}"
    )


def _args(arguments: Any) -> str:
    if isinstance(arguments, dict):
        return ", ".join(f"{k}={v!r}" for k, v in arguments.items())
    return str(arguments)


def _short(value: Any, limit: int = 160) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
