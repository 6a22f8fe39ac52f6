"""Expert memory: budgets, the three expert tiers, bandwidth oracles, the q* policy, prefetch and
`TieredExpertProvider` (the ExpertProvider that puts them together; `provider.stats()`)."""

from .budget import MemoryBudget
from .oracle import BandwidthOracle, ManualClock, ThrottledLink
from .policy import AlwaysStreamPolicy, ComputeCostModel, ExpertCase, Placement, QStarPolicy
from .prefetch import PrefetchCounters, Prefetcher
from .provider import TieredExpertProvider
from .tiers import FastTier, HostTier, LayerLRUTier, LRUTier, TierCounters

__all__ = [
    "AlwaysStreamPolicy",
    "LayerLRUTier",
    "BandwidthOracle",
    "ComputeCostModel",
    "ExpertCase",
    "FastTier",
    "HostTier",
    "LRUTier",
    "ManualClock",
    "MemoryBudget",
    "Placement",
    "PrefetchCounters",
    "Prefetcher",
    "QStarPolicy",
    "ThrottledLink",
    "TierCounters",
    "TieredExpertProvider",
]
