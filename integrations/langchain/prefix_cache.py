"""ChatFreeToken's prefix reuse is the integrations' shared implementation
(`freetoken_agents.integrations.prefix_cache`, also used by `freetoken serve`); re-exported here
for code that imported it from the LangChain package."""

from ..prefix_cache import CacheEntry, PrefixCache, prefix_key, prepare_context, record_context

__all__ = ["CacheEntry", "PrefixCache", "prefix_key", "prepare_context", "record_context"]
