"""FreeToken: tool-calling agents on large Mixture-of-Experts models on one machine.

The public names below import their modules on first use (PEP 562), so `import freetoken_agents`
(and the `freetoken` command's parser, `freetoken --help`) loads neither torch nor transformers
(issue 65); `from freetoken_agents import Agent, tool` works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # what the names are, for type checkers and import-linter
    from .agent import Agent, AgentEvent, AgentResult
    from .embedded import EmbeddedModelMissing, default_model
    from .errors import (
        AgentError,
        ContextConflict,
        DuplicateToolName,
        InvalidToolName,
        MaxStepsExceeded,
        MemoryLimitReached,
        ModelCausedError,
        ModelRetry,
        ResultRejected,
        RetryableToolError,
        SchemaRejected,
        TokenLimitTooSmall,
        ToolAborted,
        ToolArgumentsInvalid,
        ToolCallMalformed,
        ToolExecutionError,
        ToolRetryExhausted,
        ToolTimeout,
        UnexpectedModelBehavior,
        UnknownTool,
    )
    from .grounding import conversation_sources
    from .model import FreeTokenModel, GenerateRequest, ModelBackend, Usage
    from .openai_compat import ModelServerError, OpenAICompatibleModel
    from .relevance import relevant_tools, user_sources
    from .retry import RetryPolicy
    from .tools import Tool, tool
    from .trace import Trace

_MODULES: dict[str, tuple[str, ...]] = {
    ".agent": ("Agent", "AgentEvent", "AgentResult"),
    ".embedded": ("EmbeddedModelMissing", "default_model"),
    ".errors": (
        "AgentError",
        "ContextConflict",
        "DuplicateToolName",
        "InvalidToolName",
        "MaxStepsExceeded",
        "MemoryLimitReached",
        "ModelCausedError",
        "ModelRetry",
        "ResultRejected",
        "RetryableToolError",
        "SchemaRejected",
        "TokenLimitTooSmall",
        "ToolAborted",
        "ToolArgumentsInvalid",
        "ToolCallMalformed",
        "ToolExecutionError",
        "ToolRetryExhausted",
        "ToolTimeout",
        "UnexpectedModelBehavior",
        "UnknownTool",
    ),
    ".grounding": ("conversation_sources",),
    ".model": ("FreeTokenModel", "GenerateRequest", "ModelBackend", "Usage"),
    ".openai_compat": ("ModelServerError", "OpenAICompatibleModel"),
    ".relevance": ("relevant_tools", "user_sources"),
    ".retry": ("RetryPolicy",),
    ".tools": ("Tool", "tool"),
    ".trace": ("Trace",),
}
"""Submodule -> the public names it provides (the `TYPE_CHECKING` imports above, as data)."""
_EXPORTS: dict[str, str] = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "Agent",
    "AgentError",
    "AgentEvent",
    "AgentResult",
    "ContextConflict",
    "DuplicateToolName",
    "EmbeddedModelMissing",
    "InvalidToolName",
    "FreeTokenModel",
    "GenerateRequest",
    "MaxStepsExceeded",
    "MemoryLimitReached",
    "ModelBackend",
    "ModelCausedError",
    "ModelRetry",
    "ModelServerError",
    "OpenAICompatibleModel",
    "ResultRejected",
    "RetryPolicy",
    "RetryableToolError",
    "SchemaRejected",
    "TokenLimitTooSmall",
    "Tool",
    "ToolArgumentsInvalid",
    "ToolCallMalformed",
    "ToolAborted",
    "ToolExecutionError",
    "ToolRetryExhausted",
    "ToolTimeout",
    "Trace",
    "UnexpectedModelBehavior",
    "UnknownTool",
    "Usage",
    "__version__",
    "conversation_sources",
    "relevant_tools",
    "user_sources",
    "default_model",
    "tool",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then a plain module global)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
