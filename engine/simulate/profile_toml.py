"""Reading a hardware profile's TOML text (`profiles.load_profile`): the TOML module, the line of
each key, and the line a parse fails on where the parser does not say."""

from __future__ import annotations

import re
import sys
from typing import Any


def key_lines(text: str) -> dict[str, int]:
    """The line each top-level `key = ...` of a TOML text starts on (bare or quoted key; the first
    one of each)."""
    lines: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        m = _KEY.match(line)
        if m:
            lines.setdefault(next(g for g in m.groups() if g is not None), number)
    return lines


_KEY = re.compile(r"""\s*(?:([A-Za-z0-9_-]+)|"([^"\\]*)"|'([^']*)')\s*=""")


def failing_line(toml: Any, text: str) -> int:
    """The line of `text` where its parser fails without saying where (a RecursionError, or an
    int past Python's digit limit): the fewest leading lines that fail so, found by bisection
    (a prefix that stops short of that line parses, or fails with a TOMLDecodeError)."""
    lines = text.splitlines(keepends=True)

    def fails(n: int) -> bool:
        try:
            toml.loads("".join(lines[:n]))
        except toml.TOMLDecodeError:
            return False
        except (RecursionError, ValueError):
            return True
        return False

    lo, hi = 1, max(1, len(lines))  # the whole text fails
    while lo < hi:
        mid = (lo + hi) // 2
        if fails(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def toml_module() -> Any:
    """tomllib (Python 3.11+), else the tomli backport, else None."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:
        import tomli
    except ImportError:
        return None
    return tomli
