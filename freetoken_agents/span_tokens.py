"""The tokens that keep a grounded value being written a span of the conversation's text (or one
of the enum values it mentions), or end it where a span may end: the vocabulary's pieces
(`spans.PieceTable`) matched against the sources' texts (`spans.Source`) from each place a value
may start. `grounding.SpanGrounding` decides which starts apply; these only look them up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .spans import PieceTable, Source


def span_tokens(
    table: PieceTable,
    sources: list[Source],
    value: bytes,
    empty_closes: bool,
    named: Mapping[Source, set[int]] | None = None,
    excluded: Mapping[Source, set[int]] | None = None,
    whole: bool = False,
) -> set[int]:
    """Tokens that keep `value` a span of a source (one starting where `named` says for that
    source, if given, and not where `excluded` says), or end it where a span may end (`whole`:
    not before a number's fraction)."""
    empty = not value and empty_closes and named is None  # a named value is not empty
    ids: set[int] = set(table.closing.get(b"", ())) if empty else set()
    for source in sources:
        text = source.text
        begins = named.get(source, ()) if named is not None else None
        barred = excluded.get(source, ()) if excluded is not None else ()
        start = text.find(value)
        while start >= 0:
            after = start + len(value)
            last = source.last_end(start)  # a quoted value ends at its quote
            begins_here = start in begins if begins is not None else start not in barred
            if source.starts[start] and after <= last and begins_here:
                ends_here = source.only_start.get
                cut = source.point_ends if whole else ()
                if value and source.ends[after] and ends_here(after, start) == start and after not in cut:
                    ids.update(table.closing.get(b"", ()))
                for end in range(after + 1, min(last, after + table.longest) + 1):
                    written = text[after:end]
                    if source.next_end[end] <= last:  # it can still end before a wall
                        ids.update(table.continuing.get(written, ()))
                    if source.ends[end] and ends_here(end, start) == start and end not in cut:
                        ids.update(table.closing.get(written, ()))
            start = text.find(value, start + 1)
    return ids


def enum_tokens(table: PieceTable, values: Sequence[bytes], value: bytes) -> set[int]:
    """Tokens that keep the open value a prefix of one of `values`, or end it on one."""
    ids: set[int] = set()
    for wanted in values:
        if not wanted.startswith(value):
            continue
        rest = wanted[len(value) :]
        if not rest:
            ids.update(table.closing.get(b"", ()))
        for n in range(1, min(len(rest), table.longest) + 1):
            ids.update(table.continuing.get(rest[:n], ()))
            if n == len(rest):
                ids.update(table.closing.get(rest, ()))
    return ids
