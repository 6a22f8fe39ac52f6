"""`freetoken chat [--model PATH]`: an interactive, streaming chat that reads stdin (so it can be
piped), with manual anchors and rollback:

    /anchor [label]         place an anchor after the last turn
    /rollback [label|id]    go back to that anchor (default: the latest): its context and history
    /anchors                list the anchors
    /stats                  the engine's placement, expert tiers and KV cache
    /help, /quit
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engine import EngineError
from ..engine.flags import engine_options
from ..recipes._common import (
    add_model_argument,
    model_path,
    one_line,
    positive_int,
    use_threads,
)
from .argtypes import non_negative_float
from .common import CLIError, model_label, show_progress, sync_with_progress, write

if TYPE_CHECKING:
    from ..anchors import AnchorHandle
    from ..model import FreeTokenModel

# The model, the chat turn and their torch load inside the functions that run the chat, never for
# `freetoken --help` (issue 65).

HELP = """commands:
  /anchor [label]       place an anchor after the last turn
  /rollback [label|id]  back to an anchor (default: the latest): the model's context and the history
  /anchors              list the anchors
  /stats                the engine's placement, expert tiers and KV cache
  /help                 this help
  /quit                 leave (so does end of input)
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a model on stdin/stdout, streaming, with /anchor and /rollback",
        description="Interactive, streaming chat. It reads stdin, so it can be piped.\n\n" + HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_argument(p)
    p.add_argument("--system", default="You are a helpful assistant.", help="system prompt ('' for none)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="per reply (default 256)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-progress", action="store_true", help="no prefill progress bar")
    p.set_defaults(run=run)


@dataclass(frozen=True)
class _Mark:
    """A chat anchor: the model's anchor and how many messages the history had then."""

    handle: AnchorHandle
    messages: int


class ChatSession:
    """The chat's state: the model's context, the message history and the anchors."""

    def __init__(self, model: FreeTokenModel, args: argparse.Namespace) -> None:
        self.model, self.args = model, args
        self.messages: list[dict[str, Any]] = []
        self.marks: list[_Mark] = []
        model.reset()
        if args.system:
            self.messages.append({"role": "system", "content": args.system})
            self._sync(generation_prompt=False)
            self.marks.append(_Mark(model.anchor("system_prompt"), len(self.messages)))

    def _sync(self, *, generation_prompt: bool) -> None:
        ids = self.model.render(self.messages, None, generation_prompt=generation_prompt)
        sync_with_progress(self.model, ids, progress=show_progress(self.args.no_progress))

    def reply(self, text: str) -> None:
        """Stream the model's reply to `text`, then keep the turn in the history. A message that
        would not leave room in the model's context for a reply is refused (CLIError, the
        history unchanged); a reply stops where the context ends."""
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = self.model.render(messages, None, generation_prompt=True)
        limit = self.model.max_context
        if len(ids) + 1 >= limit:
            raise CLIError(
                f"message not sent: with it the conversation is {len(ids)} tokens and the model's "
                f"context is {limit} (a reply needs room too); send a shorter one or /rollback"
            )
        from ..integrations.chat_turn import ChatTurnRequest, ContentDelta, run_chat_turn
        from ..sync_bridge import iterate_on, step_worker

        self.messages = messages
        self._sync(generation_prompt=True)
        request = ChatTurnRequest(
            ids=ids,
            max_tokens=self.args.max_new_tokens,
            temperature=self.args.temperature,
            seed=self.args.seed,
        )
        write("assistant> ")
        answer = ""
        # the chat keeps its context itself (its anchors, /rollback): no prefix cache
        turn = run_chat_turn(self.model, None, request, reuse=False)
        for event in iterate_on(step_worker(self.model.step_owner), turn):  # the engine's one executor
            if isinstance(event, ContentDelta):
                answer += event.text
                write(event.text)
        write("\n")
        self.messages.append({"role": "assistant", "content": answer})
        if len(self.model.render(self.messages, None, generation_prompt=False)) < limit:
            self._sync(generation_prompt=False)  # the turn as the template renders it: anchors stay valid

    def anchor(self, label: str | None) -> None:
        if not self.messages:
            raise CLIError("nothing to anchor yet: say something first")
        handle = self.model.anchor("manual", label=label)
        self.marks.append(_Mark(handle, len(self.messages)))
        shown = f" '{label}'" if label else ""
        n = len(self.messages)
        write(f"[anchor {handle.id[:8]}{shown} at token {handle.position}, after {n} messages]\n")

    def rollback(self, key: str | None) -> None:
        self.marks = [m for m in self.marks if m.handle in self.model.anchors]  # cut-off ones are gone
        mark = self._find(key)
        start = self.model.position
        outcome = self.model.rollback(mark.handle)
        del self.messages[mark.messages :]
        kept = outcome.to_position
        rebuilt = " (rebuilt by prefill)" if outcome.rebuilt else ""
        write(
            f"[rollback to {mark.handle.id[:8]}: position {start} -> {kept} ({kept} tokens kept, "
            f"{start - kept} discarded){rebuilt}; history back to {len(self.messages)} messages]\n"
        )

    def _find(self, key: str | None) -> _Mark:
        if not self.marks:
            raise CLIError("no anchor to roll back to: place one with /anchor")
        if key is None:
            return self.marks[-1]
        for mark in reversed(self.marks):
            if mark.handle.label == key or mark.handle.id.startswith(key):
                return mark
        raise CLIError(f"no anchor {key!r}; /anchors lists them")

    def list_anchors(self) -> None:
        self.marks = [m for m in self.marks if m.handle in self.model.anchors]
        for m in self.marks:
            label = f" '{m.handle.label}'" if m.handle.label else ""
            write(f"  {m.handle.id[:8]} {m.handle.kind}{label} at token {m.handle.position}\n")
        if not self.marks:
            write("  (no anchors)\n")


def stats_lines(stats: dict[str, Any]) -> str:
    """`engine.stats()` for people: placement, each expert tier's use and hits, the KV cache."""
    from ..engine.memory.budget import format_size

    out = [f"  placement: {stats['placement']} ({stats.get('placement_reason', '')})"]
    for name, tier in (stats.get("tiers") or {}).items():
        if "used_bytes" in tier:
            cap = tier.get("capacity_bytes")
            room = format_size(cap) if cap is not None else "unbounded"
            out.append(
                f"  {name}: {tier['entries']} experts, {format_size(tier['used_bytes'])} of {room}; "
                f"hits {tier['hits']}, misses {tier['misses']}, evictions {tier['evictions']}"
            )
        else:
            out.append(f"  {name}: {tier.get('reads', 0)} reads, {format_size(tier.get('bytes_read', 0))}")
    if "policy" in stats:
        decisions = ", ".join(f"{k} {v}" for k, v in sorted(stats["policy"].get("decisions", {}).items()))
        out.append(f"  q* decisions: {decisions or 'none yet'}")
    if stats.get("experts_in_ram") is not None:
        out.append(f"  experts in RAM: {stats['experts_in_ram']}")
    out.append(f"  KV cache: {stats['kv_blocks_in_use']} blocks, {format_size(stats['kv_bytes_in_use'])}")
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace) -> int:
    from ..model import FreeTokenModel

    use_threads(args.threads, args.model)
    path = model_path(args.model)
    options = engine_options(args, progress=show_progress(args.no_progress))
    session = ChatSession(FreeTokenModel.from_pretrained(path, **options.as_kwargs()), args)
    interactive = sys.stdin.isatty()
    if interactive:
        write(f"chatting with {model_label(args.model, path)}; /help for commands\n")
    while True:
        if interactive:
            write("you> ")
        line = sys.stdin.readline()
        if not line:
            return 0
        line = line.strip()
        if not line:
            continue
        command, _, rest = line.partition(" ")
        try:
            if not line.startswith("/"):
                session.reply(line)
            elif command == "/quit":
                return 0
            elif command == "/help":
                write(HELP)
            elif command == "/anchor":
                session.anchor(rest.strip() or None)
            elif command == "/rollback":
                session.rollback(rest.strip() or None)
            elif command == "/anchors":
                session.list_anchors()
            elif command == "/stats":
                write(stats_lines(session.model.engine.stats()))
            else:
                raise CLIError(f"unknown command {command}; /help lists them")
        except (CLIError, EngineError) as e:  # a bad line, command or anchor: say so, keep chatting
            write(f"[{one_line(e)}]\n")
