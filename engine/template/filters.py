"""The filters and globals a chat template sees that can build a large value: Jinja's own (and
transformers' `tojson`, `dict`, `namespace`, `raise_exception`, `strftime_now`), each checked
against the render's budget before it runs and returning exactly what the unchecked one returns."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import filters as jf
from jinja2.sandbox import MAX_RANGE
from jinja2.utils import Namespace, generate_lorem_ipsum
from markupsafe import soft_str

from .budget import BudgetExceeded, current
from .guards import checked_binop, is_int, percent_size, replace_size, text_size

_TEXT = (str, bytes, bytearray)
_SEQ = (list, tuple)


def _center(value: Any, width: int = 80) -> str:
    current().value(max(len(soft_str(value)), width if is_int(width) else 0))
    return jf.do_center(value, width)


def _indent(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    s = soft_str(s)
    step = width if is_int(width) else len(soft_str(width))
    current().value(len(s) + (s.count("\n") + 1) * max(step, 0))
    return jf.do_indent(s, width, first, blank)


def _format(value: Any, *args: Any, **kwargs: Any) -> str:
    state = current()
    state.value(percent_size(state, soft_str(value), kwargs or args))
    return jf.do_format(value, *args, **kwargs)


@jinja2.pass_eval_context
def _join_filter(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    state = current()
    items = list(value)
    if attribute is not None:
        items = list(map(jf.make_attrgetter(eval_ctx.environment, attribute), items))
    size = sum(text_size(state, x) for x in items) + text_size(state, d) * max(len(items) - 1, 0)
    state.value(size)
    return jf.sync_do_join(eval_ctx, items, d)


@jinja2.pass_eval_context
def _replace_filter(eval_ctx: Any, s: Any, old: Any, new: Any, count: int | None = None) -> str:
    current().value(replace_size(soft_str(s), soft_str(old), soft_str(new), -1 if count is None else count))
    return jf.do_replace(eval_ctx, s, old, new, count)


def _check_fill(count: Any, fill_with: Any) -> None:
    if is_int(count) and count > MAX_RANGE:
        raise BudgetExceeded(f"the chat template asked for over {MAX_RANGE} groups (MAX_RANGE)")
    if fill_with is not None and is_int(count):
        state = current()
        state.value(state.measure(fill_with) * count)


def _batch(value: Any, linecount: int, fill_with: Any = None) -> Any:
    _check_fill(linecount, fill_with)
    return jf.do_batch(value, linecount, fill_with)


def _slice(value: Any, slices: int, fill_with: Any = None) -> Any:
    _check_fill(slices, fill_with)
    return jf.sync_do_slice(value, slices, fill_with)


@jinja2.pass_environment
def _wordwrap(
    environment: Any,
    s: Any,
    width: int = 79,
    break_long_words: bool = True,
    wrapstring: str | None = None,
    break_on_hyphens: bool = True,
) -> str:
    s = soft_str(s)
    lines = len(s) // max(width, 1) + s.count("\n") + 1 if is_int(width) else 1
    if lines > MAX_RANGE:
        raise BudgetExceeded(f"the chat template asked for over {MAX_RANGE} wrapped lines (MAX_RANGE)")
    joint = environment.newline_sequence if wrapstring is None else wrapstring
    current().value(len(s) + lines * len(soft_str(joint)))
    return jf.do_wordwrap(environment, s, width, break_long_words, wrapstring, break_on_hyphens)


def _striptags(value: Any) -> str:
    s = soft_str(value)
    # Markup.striptags cuts one tag at a time, copying the rest: tags x length characters
    if s.count("<") * len(s) > 64 * current().budget.max_chars:
        raise BudgetExceeded("the chat template asked striptags for too much work (TEMPLATE_MAX_CHARS)")
    return jf.do_striptags(value)


@jinja2.pass_environment
def _sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    items = list(iterable)
    if attribute is not None:
        items = list(map(jf.make_attrgetter(environment, attribute), items))
    if all(isinstance(x, (int, float)) for x in (start, *items)):
        return sum(items, start)  # numbers: exactly the builtin (its float summation included)
    if isinstance(start, _TEXT):
        raise TypeError("sum() can't sum strings [use ''.join(seq) instead]")
    state, total = current(), start
    for item in items:
        state.tick()
        total = checked_binop(state, "+", total, item, lambda a, b: a + b)
    return total


def _pprint(value: Any) -> str:
    current().value(nested_size(value, 1))
    return jf.do_pprint(value)


def _string_filter(value: Any) -> str:
    if not isinstance(value, str):
        current().value(current().measure(value))
    return soft_str(value)


def tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """transformers' `tojson` filter (``json.dumps`` with its options, no HTML escaping), checked."""
    pad = len(indent) if isinstance(indent, str) else indent if is_int(indent) else 0
    seps = separators if isinstance(separators, _SEQ) else ()
    extra = max([0, *(len(s) for s in seps if isinstance(s, str))])
    current().value(nested_size(x, max(pad, 0) + extra) if pad or extra else current().measure(x))
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def nested_size(value: Any, pad: int) -> int:
    """`measure` plus `pad` characters per item per level of nesting: an indented dump's size."""
    state = current()
    limit, total, stack = state.budget.max_chars, 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Namespace):
            item = object.__getattribute__(item, "_Namespace__attrs")
        if isinstance(item, (list, tuple, dict, set, frozenset)) and depth < 2000:
            total += 2 + (pad * (depth + 1) + 4) * len(item)
            if total > limit:
                return total
            stack.extend((x, depth + 1) for x in (item.items() if isinstance(item, dict) else item))
        else:
            total += state.measure(item)
            if total > limit:
                return total
    return total


def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    """Jinja's `lipsum` global, with its words (about 10 characters each) counted first."""
    words = n * max if is_int(n) and is_int(max) else 0
    current().value(10 * words)
    return generate_lorem_ipsum(n, html, min, max)


def raise_exception(message: str) -> None:
    """What transformers gives templates to refuse their input."""
    raise jinja2.exceptions.TemplateError(message)


def strftime_now(format: str) -> str:  # noqa: A002
    return datetime.now().strftime(format)


class TemplateDict:
    """transformers' `dict` global: building dicts, without the class itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        result = dict(*args, **kwargs)
        current().value(current().measure(result))
        return result

    def fromkeys(self, keys: Any, value: Any = None) -> dict:
        keys = list(keys)
        current().value(current().measure(value) * len(keys))
        return dict.fromkeys(keys, value)


class TemplateNamespace(Namespace):
    """transformers' `namespace`: no underscore-prefixed attributes (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Namespace's own signature trick
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            TemplateNamespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        TemplateNamespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}."
            )


GUARDED_FILTERS: dict[str, Callable] = {
    "center": _center,
    "indent": _indent,
    "format": _format,
    "join": _join_filter,
    "replace": _replace_filter,
    "batch": _batch,
    "slice": _slice,
    "wordwrap": _wordwrap,
    "striptags": _striptags,
    "sum": _sum,
    "pprint": _pprint,
    "string": _string_filter,
    "tojson": tojson,
}
"""Filters replaced by a checked version (the same result)."""

STRUCTURAL_FILTERS = frozenset(
    "abs attr batch count d default dictsort first float groupby int items join last length list map "
    "max min pprint random reject rejectattr reverse round select selectattr slice sort string sum "
    "tojson unique".split()
)
"""Filters that do not print their input as text (or check it themselves); every other filter's
input is measured first, as printing it would."""

SELECTOR_FILTERS = frozenset("attr d default first last max min random".split())
"""Filters that return a part of their input: nothing new is built."""
