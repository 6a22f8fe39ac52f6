"""Tool-call parsers, one module per chat-template family. `parser_for(...)` picks one."""

from __future__ import annotations

from .base import ParsedToolCall, ParseResult, ToolCallParser
from .call_ids import new_call_id, step_call_id, template_call_id, with_template_call_ids
from .deepseek import SEP, DeepSeekParser, DeepSeekV31Parser
from .harmony import HarmonyParser
from .hermes import HermesParser
from .mistral import MistralParser, MistralV11Parser
from .qwen3_coder import Qwen3CoderParser
from .reasoning import ReasoningMarkers, reasoning_markers

PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "mistral": MistralParser,
    "mistral_v11": MistralV11Parser,
    "deepseek": DeepSeekParser,
    "deepseek_v31": DeepSeekV31Parser,
    "harmony": HarmonyParser,
    "qwen3_coder": Qwen3CoderParser,
}


def parser_for(family: str | None = None, *, chat_template: str | None = None) -> ToolCallParser:
    """A parser by family name, or guessed from a chat template's text; Hermes by default (the
    engine's default template)."""
    if family is not None:
        try:
            return PARSERS[family]()
        except KeyError:
            raise ValueError(
                f"unknown tool-call family {family!r}; expected one of {sorted(PARSERS)}"
            ) from None
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return MistralV11Parser() if "[ARGS]" in template else MistralParser()
    if "tool▁calls▁begin" in template:  # V3 writes the call's type before the separator, V3.1 not
        return DeepSeekParser() if f"function{SEP}" in template else DeepSeekV31Parser()
    if "<|channel|>" in template:
        return HarmonyParser()
    if all(m in template for m in ("<tool_call>", "<function=", "<parameter=")):  # XML, not JSON
        return Qwen3CoderParser()
    return HermesParser()


__all__ = [
    "PARSERS",
    "DeepSeekParser",
    "DeepSeekV31Parser",
    "HarmonyParser",
    "HermesParser",
    "MistralParser",
    "MistralV11Parser",
    "ParseResult",
    "ParsedToolCall",
    "Qwen3CoderParser",
    "ReasoningMarkers",
    "ToolCallParser",
    "new_call_id",
    "parser_for",
    "reasoning_markers",
    "step_call_id",
    "template_call_id",
    "with_template_call_ids",
]
