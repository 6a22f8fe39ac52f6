"""argparse types for sampling options: a bad value is one argparse error line (exit code 2)
naming the option, never a pydantic dump from deep inside a run. Token counts use
`recipes._common.positive_int`."""

from __future__ import annotations

import argparse


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def non_negative_float(text: str) -> float:
    """A float >= 0 (temperature: 0 is greedy)."""
    value = _number(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def probability(text: str) -> float:
    """A float in (0, 1] (top-p)."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value
