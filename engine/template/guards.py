"""The operators and str/bytes/int methods a chat template can use to build a large value, each
checked against the render's budget (`budget.current()`) before it runs (the filters and
globals: `filters`).

Every check bounds the size of the result from its inputs (``len(s) * n`` for ``s * n``, the
widths in a format, the separator times the items for ``join``...) and raises `BudgetExceeded`
before anything is allocated. What each returns is exactly what the unchecked operation returns.
"""

from __future__ import annotations

import _string  # the parser str.format itself uses
import re
from collections.abc import Callable, Mapping
from functools import wraps
from typing import Any

import jinja2
from markupsafe import soft_str

from .budget import TEMPLATE_MAX_INT_BITS, BudgetExceeded, RenderState, current

_TEXT = (str, bytes, bytearray)
_SEQ = (list, tuple)


def text_size(state: RenderState, value: Any) -> int:
    return len(value) if isinstance(value, str) else state.measure(value)


# ---- operators ------------------------------------------------------------------------------------
def checked_binop(state: RenderState, op: str, left: Any, right: Any, fn: Callable) -> Any:
    """`fn(left, right)` for the intercepted operators ``* + % **``, refused past the budget."""
    if op == "*":
        _check_repeat(state, left, right)
    elif op == "+":
        if isinstance(left, _TEXT) and isinstance(right, _TEXT):
            state.value(len(left) + len(right))
        elif isinstance(left, _SEQ) and isinstance(right, _SEQ):
            state.value(state.measure(left) + state.measure(right))
    elif op == "%" and isinstance(left, _TEXT):
        state.value(percent_size(state, left, right))
    elif op == "**" and is_int(left) and is_int(right) and right > 0 and abs(left) > 1:
        _check_bits(left.bit_length() * right)
    result = fn(left, right)
    state.charge(_built(result))
    return result


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_repeat(state: RenderState, left: Any, right: Any) -> None:
    if is_int(left) and is_int(right):
        _check_bits(left.bit_length() + right.bit_length())
        return
    seq, times = (left, right) if isinstance(right, int) else (right, left)
    if not isinstance(times, int) or times <= 0:
        return
    if isinstance(seq, _TEXT):
        state.value(len(seq) * times)
    elif isinstance(seq, _SEQ):
        state.value(state.measure(seq) * times)


def _check_bits(bits: int) -> None:
    if bits > TEMPLATE_MAX_INT_BITS:
        raise BudgetExceeded(
            f"the chat template built a number of over {TEMPLATE_MAX_INT_BITS} bits (TEMPLATE_MAX_INT_BITS)"
        )


def _built(value: Any) -> int:
    """What building `value` allocated, shallowly: characters, or items for a container."""
    if isinstance(value, (*_TEXT, list, tuple, dict, set, frozenset)):
        return len(value)
    return 0


def checked_concat(values: tuple, autoescape: bool) -> str:
    """The ``~`` operator (Jinja's `str_join`, or `markup_join` when autoescaping)."""
    state = current()
    pieces = []
    for value in values:
        if not isinstance(value, str):
            state.value(state.measure(value))
            value = soft_str(value) if autoescape else str(value)
        pieces.append(value)
    state.value(sum(map(len, pieces)))
    result = jinja2.runtime.markup_join(pieces) if autoescape else "".join(pieces)
    state.charge(len(result))
    return result


def checked_join(pieces: Any) -> str:
    """The environment's `concat`: joins a macro's or block's output."""
    state = current()
    pieces = list(pieces)
    size = sum(map(len, pieces))
    state.value(size)
    state.charge(size)
    return "".join(pieces)


# ---- string formatting ----------------------------------------------------------------------------
def percent_size(state: RenderState, fmt: str | bytes, args: Any) -> int:
    """An upper bound of ``len(fmt % args)``: the literal text plus, per conversion, its width,
    its precision and its argument's text, read the way printf-style formatting reads them."""
    if isinstance(fmt, (bytes, bytearray)):
        fmt = fmt.decode("latin-1")
    positional = list(args) if isinstance(args, tuple) else [args]
    mapping = args if isinstance(args, Mapping) else {}
    total, i, n, k, limit, seen = 0, 0, len(fmt), 0, state.budget.max_chars, 0
    while (j := fmt.find("%", i)) >= 0:
        if total > limit:
            return total  # refused already: no need to read the rest
        seen += 1
        if seen % 1024 == 0:
            state.tick()  # a format string of millions of conversions takes seconds to read
        total += j - i
        i, key = j + 1, None
        if i < n and fmt[i] == "(":
            depth, start = 1, i + 1
            i += 1
            while i < n and depth:
                depth += (fmt[i] == "(") - (fmt[i] == ")")
                i += 1
            key = fmt[start : i - 1]
        while i < n and fmt[i] in "-+ #0":
            i += 1
        width, i, k = _printf_number(fmt, i, positional, k)
        precision = 0
        if i < n and fmt[i] == ".":
            precision, i, k = _printf_number(fmt, i + 1, positional, k)
        while i < n and fmt[i] in "hlL":
            i += 1
        if i >= n:
            return total  # an incomplete conversion: the operator raises
        conversion, i = fmt[i], i + 1
        if conversion == "%":
            total += 1
            continue
        if key is not None:
            arg = mapping.get(key, "")
        else:
            arg = positional[k] if k < len(positional) else ""
            k += 1
        total += width + precision + text_size(state, arg)
    return total + n - i


def _printf_number(fmt: str, i: int, positional: list, k: int) -> tuple[int, int, int]:
    if i < len(fmt) and fmt[i] == "*":
        value = positional[k] if k < len(positional) else 0
        return (abs(value) if is_int(value) else 0), i + 1, k + 1
    j = i
    while j < len(fmt) and fmt[j].isdigit():
        j += 1
    digits = j - i
    return (0 if not digits else int(fmt[i:j]) if digits < 20 else 1 << 64), j, k


_DIGITS = re.compile(r"\d+")


def format_size(state: RenderState, fmt: str, args: tuple, kwargs: Mapping) -> int:
    """An upper bound of ``len(fmt.format(*args, **kwargs))``, from str.format's own parser."""
    sizes = [text_size(state, a) for a in args]
    sizes_by_name = {name: text_size(state, v) for name, v in kwargs.items()}
    widest = max([0, *sizes, *sizes_by_name.values()])
    largest = max([0, *(abs(v) for v in (*args, *kwargs.values()) if is_int(v))])
    total, auto, limit = 0, 0, state.budget.max_chars
    for fields, (literal, field, spec, _conversion) in enumerate(_string.formatter_parser(fmt)):
        if total > limit:
            return total  # refused already: no need to read the rest
        if fields % 1024 == 1023:
            state.tick()  # a format string of millions of fields takes seconds to read
        total += len(literal)
        if field is None:
            continue
        if "{" in (spec or ""):
            # a nested width refers to another argument: count the widest, and the largest
            # integer argument as a width
            total += widest + largest + len(spec)
            continue
        first, rest = _string.formatter_field_name_split(field)
        if first == "":
            first, auto = auto, auto + 1
        if isinstance(first, int):
            size = sizes[first] if first < len(sizes) else 0
        else:
            size = sizes_by_name.get(first, 0)
        size += 64 if any(True for _ in rest) else 0  # an attribute or item of it: a method's repr
        total += size + sum(int(d) if len(d) < 20 else 1 << 64 for d in _DIGITS.findall(spec or ""))
    return total


def guard_format(value: Callable, wrapped: Callable) -> Callable:
    """`wrapped` (Jinja's sandboxed ``str.format``/``format_map`` for `value`) with a size check."""
    fmt, is_map = value.__self__, value.__name__ == "format_map"

    @wraps(wrapped)
    def checked(*args: Any, **kwargs: Any) -> str:
        state = current()
        if is_map:
            mapping = args[0] if len(args) == 1 and isinstance(args[0], Mapping) else {}
            state.value(format_size(state, fmt, (), mapping))
        else:
            state.value(format_size(state, fmt, args, kwargs))
        return wrapped(*args, **kwargs)

    return checked


# ---- str, bytes and int methods ---------------------------------------------------------------------
def _width(owner: Any, args: tuple, kwargs: dict) -> tuple[int, tuple]:
    width = args[0] if args else 0
    return max(len(owner), width if is_int(width) else 0), args


def _expandtabs(owner: Any, args: tuple, kwargs: dict) -> tuple[int, tuple]:
    size = args[0] if args else kwargs.get("tabsize", 8)
    tab = "\t" if isinstance(owner, str) else b"\t"
    return len(owner) + owner.count(tab) * (max(size, 0) if is_int(size) else 0), args


def _replace(owner: Any, args: tuple, kwargs: dict) -> tuple[int, tuple]:
    old, new = (args + (None, None))[:2]
    count = args[2] if len(args) > 2 else kwargs.get("count", -1)
    return replace_size(owner, old, new, count), args


def replace_size(s: Any, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, _TEXT) or not isinstance(new, _TEXT) or type(old) is not type(new):
        return len(s)  # the call raises TypeError
    hits = len(s) + 1 if not old else s.count(old)
    if is_int(count) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _join(owner: Any, args: tuple, kwargs: dict) -> tuple[int, tuple]:
    if len(args) != 1:
        return len(owner), args
    items = list(args[0])  # materialised once: the join gets the same items
    size = sum(len(x) for x in items if isinstance(x, _TEXT)) + len(owner) * max(len(items) - 1, 0)
    return size, (items,)


def _translate(owner: Any, args: tuple, kwargs: dict) -> tuple[int, tuple]:
    table = args[0] if args else None
    values = table.values() if isinstance(table, Mapping) else table if isinstance(table, _SEQ) else ()
    longest = max([1, *(len(v) for v in values if isinstance(v, str))])
    return len(owner) * longest, args


def _to_bytes(owner: Any, args: tuple, kwargs: dict) -> tuple[int, tuple]:
    length = args[0] if args else kwargs.get("length", 1)
    return (length if is_int(length) else 0), args


_TEXT_METHODS = {
    "center": _width,
    "ljust": _width,
    "rjust": _width,
    "zfill": _width,
    "expandtabs": _expandtabs,
    "replace": _replace,
    "join": _join,
    "translate": _translate,
}


def guard_method(value: Any) -> Any:
    """`value` itself, or, for a str/bytes/int method that can build a large value from small
    arguments, a function that checks the size first."""
    owner = getattr(value, "__self__", None)
    name = getattr(value, "__name__", None)
    if isinstance(owner, _TEXT):
        size_of = _TEXT_METHODS.get(name)
    elif is_int(owner) and name == "to_bytes":
        size_of = _to_bytes
    else:
        return value
    if size_of is None:
        return value

    def checked(*args: Any, **kwargs: Any) -> Any:
        size, args = size_of(owner, args, kwargs)
        current().value(size)
        return value(*args, **kwargs)

    return checked
