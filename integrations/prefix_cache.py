"""Content-addressed prefix reuse across calls that re-send a whole conversation: one
implementation for ChatFreeToken (LangChain re-sends the history every call) and `freetoken
serve` (every OpenAI client does).

Each prompt prefilled is pinned with an engine anchor and recorded under the hash of its token
prefix (blake2b of the token ids, plus the length); `record_context` can also pin a prompt with
its reply. On the next call `prepare_context` keeps the longer of (a) the live session's common
prefix with the new prompt and (b) the longest recorded prefix of the new prompt, restored from
its anchor by pointer work; only the suffix past it is prefilled. The tokens not prefilled are
what the callers report as cache reads (`input_token_details.cache_read`,
`prompt_tokens_details.cached_tokens`).

Reuse is scoped by a tenant string (the server's: API key and `user`): a prompt reuses only KV its
own tenant's prompts left, pinned or live, so the prefill it saves (reported, and visible in its
latency) reveals nothing about another tenant's prompts.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import TYPE_CHECKING, Any

from freetoken_agents.model import common_prefix_length

if TYPE_CHECKING:
    from freetoken_agents.model import FreeTokenModel

logger = logging.getLogger(__name__)


def prefix_key(ids: Sequence[int], length: int) -> bytes:
    """Content address of `ids[:length]`: 16-byte blake2b of the int32 ids, then the length."""
    digest = blake2b(array("i", ids[:length]).tobytes(), digest_size=16).digest()
    return digest + length.to_bytes(8, "little")


@dataclass(frozen=True)
class CacheEntry:
    """A recorded prefix. position: its length in tokens; anchor: the engine Anchor pinning it."""

    position: int
    anchor: Any


class PrefixCache:
    """Map (tenant, prefix_key) -> CacheEntry, least recently used first out (its anchor is
    discarded). `tenant` scopes reuse: a lookup finds only its own tenant's prefixes, and
    `live_tenant` is whose prompt the live session holds (another tenant starts from an empty
    context). One tenant ("", the default) for a single user."""

    def __init__(self, max_entries: int = 32) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, bytes], CacheEntry] = OrderedDict()
        self.live_tenant = ""

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: Sequence[int], tenant: str = "") -> CacheEntry | None:
        """The longest recorded prefix of `ids` among `tenant`'s, or None."""
        lengths = {e.position for (owner, _), e in self._entries.items() if owner == tenant}
        for length in sorted(lengths, reverse=True):
            if length <= len(ids):
                key = (tenant, prefix_key(ids, length))
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
                    return entry
        return None

    def add(self, ids: Sequence[int], anchor: Any, store: Any, tenant: str = "") -> None:
        """Record `ids` as pinned by `anchor`; evicted entries' anchors are discarded from `store`."""
        key = (tenant, prefix_key(ids, len(ids)))
        self._entries[key] = CacheEntry(len(ids), anchor)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            _, old = self._entries.popitem(last=False)
            if old.anchor is not anchor:
                store.discard(old.anchor.id)

    def forget(self, entry: CacheEntry) -> None:
        for key, e in list(self._entries.items()):
            if e is entry:
                del self._entries[key]


def prepare_context(
    backend: FreeTokenModel, cache: PrefixCache, ids: list[int], *, reuse: bool, tenant: str = ""
) -> int:
    """Make the backend's context exactly `ids` with next-token logits ready.

    Returns the number of prompt tokens reused instead of prefilled (cache_read). With
    `reuse=False` the session is reset and everything is prefilled (returns 0). Only `tenant`'s
    own prefixes are reused: a live context another tenant left is emptied first.
    """
    if not reuse:
        backend.reset()
        backend.sync(ids)
        backend.next_logits()
        return 0
    if cache.live_tenant != tenant:
        backend.truncate(0)  # another tenant's prompt: nothing of it may shorten this prefill
        cache.live_tenant = tenant
    live = common_prefix_length(backend.token_ids, ids)
    entry = cache.lookup(ids, tenant)
    source = "live session"
    if entry is not None and entry.position > live:
        try:
            backend.restore(entry.anchor)  # checked with the backend's `validate`
            source = f"anchor {entry.anchor.id}"
        except Exception as e:  # evicted by the engine's anchor budget, or failed validation
            logger.debug("prefix cache: anchor %s unusable (%s); dropping it", entry.anchor.id, e)
            cache.forget(entry)
    before = backend.usage().prefilled
    backend.sync(ids)
    backend.next_logits()
    prefilled = backend.usage().prefilled - before
    reused = max(0, len(ids) - prefilled)
    if backend.position == len(ids):
        cache.add(ids, backend.pin("manual", label="prompt"), backend.engine.anchors, tenant)
    logger.debug(
        "prefix cache: reused %d of %d prompt tokens from %s, prefilled %d",
        reused,
        len(ids),
        source,
        prefilled,
    )
    return reused


def record_context(backend: FreeTokenModel, cache: PrefixCache, tenant: str = "") -> None:
    """Pin the backend's whole context (a prompt and the reply generated after it) in `cache`, so
    the conversation's next request finds it even after other conversations used the session."""
    ids = backend.token_ids
    entry = cache.lookup(ids, tenant)
    if ids and (entry is None or entry.position < len(ids)):
        cache.add(ids, backend.pin("manual", label="reply"), backend.engine.anchors, tenant)
