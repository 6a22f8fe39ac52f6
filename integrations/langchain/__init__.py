"""LangChain integration: `ChatFreeToken`, a `BaseChatModel` over the FreeToken engine.

Needs `langchain-core` (a dependency of freetoken-agents). See `chat_model.ChatFreeToken`.
"""

from .chat_model import ChatFreeToken
from .engines import clear_engines, shared_engine

__all__ = ["ChatFreeToken", "clear_engines", "shared_engine"]
