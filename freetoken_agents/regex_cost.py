"""How large a JSON-schema `pattern` makes the grammar, estimated without compiling it.

The grammar compiler (xgrammar) expands a bounded repetition into copies of what it repeats:
`x{m,n}` becomes n copies of x (m required, n - m optional), nested repetitions multiply, and its
compile time grows with the copies (quadratically for one run of optional copies): on the
embedded model's vocabulary `a{1,1000}` compiled in 0.1 s, `a{1,4000}` in 1.7 s, `a{1,9999}` in
15 s and `(a|b){1,20000}` in more than 90 s, each on the one thread that serves every client.

`pattern_states` counts those copies the way the compiler makes them: every atom (a character,
an escape, a class, `.`) is one state; a group is the sum of its alternatives; a quantifier
multiplies its atom or group by its upper bound (`{m,n}`: n, `{m,}`: m + 1, `{m}`: m, `+`: 2,
`*` and `?`: 1). It reads the pattern once, left to right, with an explicit stack (no
recursion), and stops as soon as the count passes `limit`, so neither a long pattern nor a
100-digit bound costs more than reading it.
"""

from __future__ import annotations

import re

__all__ = ["PatternTooCostly", "pattern_states"]

_BOUND = re.compile(r"\{(\d+)(,(\d*))?\}")
_MAX_BOUND_DIGITS = 9  # a bound with more digits is over every limit: never turned into an int


class PatternTooCostly(ValueError):
    """The pattern's estimated states passed the limit (`states`: the count when it stopped,
    already over `limit`)."""

    def __init__(self, states: int, limit: int) -> None:
        super().__init__(f"expands to more than {limit} states (at least {states})")
        self.states, self.limit = states, limit


class _Group:
    """An open group: `total` states so far (its alternatives summed) and `last`, the size of the
    item a following quantifier repeats (0: none, e.g. right after `(` or `|`)."""

    __slots__ = ("last", "total")

    def __init__(self) -> None:
        self.total = self.last = 0


def pattern_states(pattern: str, limit: int) -> int:
    """The estimated states of `pattern`'s automaton (see the module's docstring); raises
    PatternTooCostly once they pass `limit`. A malformed pattern is counted as well as it reads
    (the compiler refuses it later with its own message)."""
    stack = [_Group()]
    i, n = 0, len(pattern)

    def add(size: int) -> None:
        group = stack[-1]
        group.total += size
        group.last = size
        if group.total > limit:  # sizes only grow on the way out: the whole is over too
            raise PatternTooCostly(group.total, limit)

    def repeat(times: int) -> None:
        group = stack[-1]
        extra = group.last * (max(times, 1) - 1)
        group.total += extra
        group.last += extra
        if group.total > limit:
            raise PatternTooCostly(group.total, limit)

    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2  # an escape (\d, \., \u: its hex digits then count as characters: over, not under)
            add(1)
            continue
        if c == "[":
            i = _class_end(pattern, i)
            add(1)
            continue
        if c == "(":
            i = _group_body(pattern, i + 1)
            stack.append(_Group())
            continue
        if c == ")" and len(stack) > 1:
            inner = stack.pop()
            add(inner.total)
        elif c == "|":
            stack[-1].last = 0
        elif c in "*+?":
            repeat(2 if c == "+" else 1)
            i = _lazy_or_possessive(pattern, i + 1)
            continue
        elif c == "{" and (bound := _BOUND.match(pattern, i)):
            low, comma, high = bound.group(1), bound.group(2), bound.group(3)
            if len(low) > _MAX_BOUND_DIGITS or len(high or "") > _MAX_BOUND_DIGITS:
                raise PatternTooCostly(10**_MAX_BOUND_DIGITS, limit)
            times = int(high) if high else int(low) + 1 if comma else int(low)
            if stack[-1].last:
                repeat(times)
            i = _lazy_or_possessive(pattern, bound.end())
            continue
        else:
            add(1)
        i += 1
    while len(stack) > 1:  # unclosed groups: count them as if closed
        inner = stack.pop()
        add(inner.total)
    return stack[0].total


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class opening at `i` (a `]` right after `[` or `[^` is a
    member; escapes are skipped); the pattern's end when it never closes."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def _group_body(pattern: str, i: int) -> int:
    """Skip a group's modifier after `(` (`?:`, `?=`, `?!`, `?<=`, `?<!`, `?<name>`, `?P<name>`)
    so that its `?` is not read as a quantifier; `i`: the index after `(`."""
    if not pattern.startswith("?", i):
        return i
    i += 1
    if pattern.startswith(("<=", "<!"), i):
        return i + 2
    if pattern.startswith(("<", "P<"), i):
        end = pattern.find(">", i)
        return end + 1 if end != -1 else len(pattern)
    return i + 1 if i < len(pattern) else i


def _lazy_or_possessive(pattern: str, i: int) -> int:
    """Skip the `?` (lazy) or `+` (possessive) that may follow a quantifier: not a second one."""
    return i + 1 if i < len(pattern) and pattern[i] in "?+" else i
