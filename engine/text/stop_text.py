"""Stop strings in streamed text: where one first occurs, and how much of the text's end to hold
back because it may still become one.

One implementation for every streamer: the engine's `stream_tokens`, the SDK's turn decoder
(`GenerateRequest.stop`) and the integrations' chat turn (which holds back a tool-call marker the
same way).
"""

from __future__ import annotations

from collections.abc import Sequence


def first_stop(text: str, stops: Sequence[str], searched: int = 0) -> int | None:
    """Index in `text` of the earliest occurrence of any of `stops` (empty ones ignored), or None.

    `searched`: length of a prefix of `text` already known to hold no stop string (the text before
    the last token), so a growing text is searched only where a new occurrence can end.
    """
    found = [i for i in (text.find(s, max(0, searched - len(s) + 1)) for s in stops if s) if i >= 0]
    return min(found) if found else None


def held_back_for_stops(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `stops`: the text
    a streamer holds back until it is known not to begin a stop string (0: emit everything)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
