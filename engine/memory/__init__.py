"""Expert memory: budgets, the three expert tiers (tier 3 read past the page cache by `BlockReader`),
bandwidth oracles, the q* policy, prefetch and `TieredExpertProvider` (the ExpertStore that puts
them together; `provider.stats()`)."""

from .budget import MemoryBudget
from .fast_tier import FastTier, LayerLRUTier
from .oracle import BandwidthOracle, ManualClock, ThrottledLink
from .policy import AlwaysStreamPolicy, ComputeCostModel, ExpertCase, Placement, QStarPolicy
from .prefetch import PrefetchCounters, Prefetcher
from .provider import TieredExpertProvider
from .routing import ROUTING_DECAY
from .stats import PhaseTimer
from .storage import BlockReader, new_block_buffer
from .tiers import HostTier, LRUTier, TierCounters

__all__ = [
    "AlwaysStreamPolicy",
    "BandwidthOracle",
    "BlockReader",
    "ComputeCostModel",
    "ExpertCase",
    "FastTier",
    "HostTier",
    "LayerLRUTier",
    "LRUTier",
    "ManualClock",
    "MemoryBudget",
    "PhaseTimer",
    "Placement",
    "PrefetchCounters",
    "Prefetcher",
    "QStarPolicy",
    "ROUTING_DECAY",
    "ThrottledLink",
    "TierCounters",
    "TieredExpertProvider",
    "new_block_buffer",
]
