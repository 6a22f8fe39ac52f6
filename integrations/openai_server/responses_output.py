"""The chat turn's events as Responses output items and the semantic stream events.

`OutputBuilder.feed` takes the turn's events in order (`completion.run_completion`'s: text
deltas, reasoning deltas, finished tool calls, then `Finished`) and returns the stream events they
make; `output` holds the items so far: a `reasoning` item for a thinking model's block, a
`message` item with one `output_text` part for each run of text, a `function_call` item (call_id,
name, arguments) for each call, in the order the model wrote them. A whole (non-streamed)
response is the same items, the events dropped.

Events, each with a `sequence_number` (the caller numbers them, lifecycle events included):
response.output_item.added, response.content_part.added, response.output_text.delta /
response.reasoning_text.delta, then response.output_text.done / response.reasoning_text.done,
response.content_part.done and response.output_item.done when the item ends;
response.function_call_arguments.delta and .done inside a call's added / done pair.
"""

from __future__ import annotations

from typing import Any

from .completion import ContentDelta, Event, Finished, ReasoningDelta, ToolCallDone
from .responses_schemas import new_id

Stream = list[dict[str, Any]]  # events, each a dict with its "type"


class OutputBuilder:
    """Output items from a turn's events (see the module docstring). After `Finished`:
    `finished` holds it and `incomplete` says whether the reply was cut by max_output_tokens."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self.finished: Finished | None = None
        self._open: dict[str, Any] | None = None  # the message or reasoning item being written
        self._after_call = False  # the last item is a function call: new text starts a message

    @property
    def incomplete(self) -> bool:
        return self.finished is not None and self.finished.finish_reason == "length"

    def feed(self, event: Event) -> Stream:
        if isinstance(event, ContentDelta):
            return self._text("message", event.text)
        if isinstance(event, ReasoningDelta):
            return self._text("reasoning", event.text)
        if isinstance(event, ToolCallDone):
            return self._call(event)
        self.finished = event
        return self._close("incomplete" if self.incomplete else "completed")

    # ---- text and reasoning ---------------------------------------------------------------------------
    def _text(self, kind: str, delta: str) -> Stream:
        events: Stream = []
        if self._open is not None and self._open["type"] != kind:
            events += self._close("completed")
        if self._open is None:
            if kind == "message" and self._after_call:
                delta = delta.removeprefix("\n")  # the chat path's line between a call and more text
            if not delta:
                return events
            events += self._start(kind)
        item = self._open
        assert item is not None
        item["content"][0]["text"] += delta
        where = self._where(item)
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append({"type": name, **where, "content_index": 0, "delta": delta, **extra})
        return events

    def _start(self, kind: str) -> Stream:
        part: dict[str, Any]
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {
                "id": new_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
        else:
            part = {"type": "reasoning_text", "text": ""}
            item = {
                "id": new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "status": "in_progress",
                "content": [],
            }
        self.output.append(item)
        self._open, self._after_call = item, False
        added = {
            "type": "response.output_item.added",
            "output_index": len(self.output) - 1,
            "item": _copy(item),
        }
        item["content"].append(part)
        return [
            added,
            {
                "type": "response.content_part.added",
                **self._where(item),
                "content_index": 0,
                "part": dict(part),
            },
        ]

    def _close(self, status: str) -> Stream:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        part, where = item["content"][0], self._where(item)
        name = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
        extra = {"logprobs": []} if item["type"] == "message" else {}
        return [
            {"type": name, **where, "content_index": 0, "text": part["text"], **extra},
            {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)},
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": _copy(item)},
        ]

    # ---- function calls ---------------------------------------------------------------------------------
    def _call(self, call: ToolCallDone) -> Stream:
        events = self._close("completed")
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
        }
        self.output.append(item)
        self._after_call = True
        index = len(self.output) - 1
        events.append({"type": "response.output_item.added", "output_index": index, "item": dict(item)})
        where = {"item_id": item["id"], "output_index": index}
        events.append({"type": "response.function_call_arguments.delta", **where, "delta": call.arguments})
        item.update(arguments=call.arguments, status="completed")
        events.append(
            {
                "type": "response.function_call_arguments.done",
                **where,
                "name": call.name,
                "arguments": call.arguments,
            }
        )
        events.append({"type": "response.output_item.done", "output_index": index, "item": dict(item)})
        return events

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        # the open item is always the last one: items are written one after another
        return {"item_id": item["id"], "output_index": len(self.output) - 1}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """`item` as it stands now (its parts copied: they go on changing)."""
    return {**item, "content": [dict(part) for part in item.get("content", [])]}
