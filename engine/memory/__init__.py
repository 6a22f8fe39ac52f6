"""Expert memory: budgets now; the tiered expert cache plugs in here."""

from .budget import MemoryBudget

__all__ = ["MemoryBudget"]
