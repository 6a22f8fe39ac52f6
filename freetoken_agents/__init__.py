"""FreeToken: tool-calling agents on large Mixture-of-Experts models on one machine."""

__version__ = "0.1.0"

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
