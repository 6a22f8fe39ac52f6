"""FreeToken: tool-calling agents on large Mixture-of-Experts models on one machine."""

__version__ = "0.1.0"
