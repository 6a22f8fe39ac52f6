"""Reasoning blocks: the `<think>...</think>` a thinking model writes before its answer (Qwen3,
QwQ, DeepSeek-R1 distills), and gpt-oss's analysis channel (`<|channel|>analysis<|message|>...
<|end|>`, then `<|start|>assistant<|channel|>final<|message|>` before the answer). Their templates
show the markers; vLLM and llama-server return the block apart as `reasoning_content`, and so do
we: the decoder emits it as "reasoning" events, never as the answer's text, and tool calls or code
fences inside it are not acted on. `answer_headers`: markup that may open the answer and is not
part of it (harmony's role and channel headers).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import marker_prefix_at_end


@dataclass(frozen=True)
class ReasoningMarkers:
    start: str = "<think>"
    end: str = "</think>"
    answer_headers: tuple[str, ...] = ()

    def opened_by(self, prompt_tail: str) -> bool:
        """True when the rendered prompt already opened a block (a template whose generation prompt
        ends with `<think>`, as QwQ's does): the turn starts inside it."""
        tail = prompt_tail.rstrip()
        return tail.endswith(self.start)

    def held_back(self, text: str) -> int:
        """Length of the suffix of `text` that could begin the end marker."""
        return marker_prefix_at_end(text, self.end)


def reasoning_markers(chat_template: str | None) -> ReasoningMarkers | None:
    """The markers when the chat template knows reasoning blocks (harmony's analysis channel, or
    `</think>`), else None."""
    if chat_template and HARMONY.start in chat_template:
        return HARMONY
    markers = ReasoningMarkers()
    if chat_template and markers.end in chat_template:
        return markers
    return None


HARMONY = ReasoningMarkers(
    start="<|channel|>analysis<|message|>",
    end="<|end|>",
    answer_headers=("<|start|>assistant", "<|channel|>final<|message|>"),
)
