"""What one chat-template render may cost: time, output, the size of any one value it builds and
the characters it builds in all.

A chat template is code from the checkpoint (a GGUF's ``tokenizer.chat_template``, a folder's
``chat_template.jinja``): untrusted. Jinja's sandbox stops it reaching Python internals but not
from looping for ever (nested ``range`` loops) or building a string of gigabytes (``'x' * 10**9``).
`sandbox` renders under a `TemplateBudget`: every loop iteration, call and attribute
look-up checks the deadline (`RenderState.tick`); every operation that can build a large value
checks its size before it builds it (`RenderState.value`) and charges what it built
(`RenderState.charge`), so neither time nor memory grows past the budget. A breach is a
`BudgetExceeded` inside the render and a `ChatTemplateError` naming the budget outside it.

The defaults are far above what any real template needs (they render in milliseconds and write
their prompt once): a prompt of TEMPLATE_MAX_CHARS characters is about two million tokens.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from jinja2.utils import Namespace

TEMPLATE_RENDER_SECONDS = 5.0
"""Wall-clock seconds one render (compiling included) may take."""

TEMPLATE_MAX_CHARS = 8 * 1024 * 1024
"""Characters the rendered prompt may hold, and any one value the template builds (a string, or a
list printed as text, counted through shared references)."""

TEMPLATE_MAX_ALLOCATED_CHARS = 16 * TEMPLATE_MAX_CHARS
"""Characters (and list items) one render may build in all: bounds the memory a template can keep
alive, however it holds on to what it built."""

TEMPLATE_MAX_INT_BITS = 1 << 16
"""Bits an integer built by ``*`` or ``**`` may have (big-number arithmetic is not interruptible)."""

TEMPLATE_MAX_SOURCE_CHARS = 1024 * 1024
"""Characters a chat template's source may have (compiling it is not interruptible)."""

_MAX_DEPTH = 2000  # deeper values cannot be printed (Python's recursion limit) anyway


@dataclass(frozen=True)
class TemplateBudget:
    """The limits of one render (each defaults to the module constant of its name, read when the
    budget is made); `cancelled`, when given, is polled while rendering and stops it."""

    seconds: float = field(default_factory=lambda: TEMPLATE_RENDER_SECONDS)
    max_chars: int = field(default_factory=lambda: TEMPLATE_MAX_CHARS)
    max_allocated_chars: int = field(default_factory=lambda: TEMPLATE_MAX_ALLOCATED_CHARS)
    cancelled: Callable[[], bool] | None = None


class BudgetExceeded(Exception):
    """A render broke its budget. Deliberately not a TypeError, LookupError or AttributeError: Jinja
    swallows those around look-ups and filters, this must reach `render_template`."""


class RenderState:
    """The budget of the render in progress and what it has spent."""

    def __init__(self, budget: TemplateBudget) -> None:
        self.budget = budget
        self.deadline = time.monotonic() + budget.seconds
        self.allocated = 0
        self.ticks = 0
        # id -> (value, measure): containers are immutable in the sandbox, and holding the value
        # keeps its id from being reused while the render runs
        self._sizes: dict[int, tuple[Any, int]] = {}

    def tick(self) -> None:
        """One step of template work: past the deadline or cancelled -> BudgetExceeded."""
        if time.monotonic() > self.deadline:
            raise BudgetExceeded(
                f"the chat template ran past its time budget of {self.budget.seconds:g} s "
                "(TEMPLATE_RENDER_SECONDS)"
            )
        cancelled = self.budget.cancelled
        if cancelled is not None:
            self.ticks += 1
            if self.ticks % 64 == 1 and cancelled():
                raise BudgetExceeded("the chat template render was cancelled")

    def value(self, size: int) -> None:
        """A value of `size` characters is about to be built: over the cap -> BudgetExceeded."""
        if size > self.budget.max_chars:
            raise BudgetExceeded(
                f"the chat template built a value of over {self.budget.max_chars} characters "
                "(TEMPLATE_MAX_CHARS)"
            )

    def charge(self, size: int) -> None:
        """`size` characters (or list items) were built."""
        self.allocated += size
        if self.allocated > self.budget.max_allocated_chars:
            raise BudgetExceeded(
                f"the chat template built over {self.budget.max_allocated_chars} characters in all "
                "(TEMPLATE_MAX_ALLOCATED_CHARS)"
            )

    def measure(self, obj: Any) -> int:
        """About the characters of `obj` printed as text (its repr inside a container), counting a
        shared item once per place it appears; stops counting past `max_chars`. Containers are
        remembered, so measuring a value built from measured ones costs one step per item."""
        leaf = _leaf(obj)
        if leaf is not None:
            return leaf
        sizes, limit = self._sizes, self.budget.max_chars
        known = sizes.get(id(obj))
        if known is not None:
            return known[1]
        # frames: [value, its items, characters so far, memoizable]; a namespace can change
        # after it is measured, so neither it nor what holds it is remembered
        stack = [[obj, _items(obj), _overhead(obj), not isinstance(obj, Namespace)]]
        running = stack[0][2]
        while stack:
            top = stack[-1]
            for item in top[1]:
                size = _leaf(item)
                if size is None:
                    known = sizes.get(id(item))
                    if known is None:
                        frame = [item, _items(item), _overhead(item), not isinstance(item, Namespace)]
                        running += frame[2]
                        if running > limit or len(stack) > _MAX_DEPTH:
                            return limit + 1
                        stack.append(frame)
                        break
                    size = known[1]
                top[2] += size
                running += size
                if running > limit:
                    return limit + 1
            else:
                stack.pop()
                if top[3]:
                    sizes[id(top[0])] = (top[0], top[2])
                if not stack:
                    return top[2]
                stack[-1][2] += top[2]
                stack[-1][3] = stack[-1][3] and top[3]
        return running  # unreachable: the loop returns when the stack empties


def _leaf(obj: Any) -> int | None:
    """The printed size of a value without items; None for a container or namespace."""
    if isinstance(obj, str):
        return len(obj) + 2
    if isinstance(obj, (bytes, bytearray)):
        return len(obj) + 3
    if obj is None or isinstance(obj, (bool, float)):
        return 8
    if isinstance(obj, int):
        return obj.bit_length() // 3 + 2
    if isinstance(obj, (list, tuple, dict, set, frozenset, Namespace)):
        return None
    return 32  # a runtime object (undefined, loop, macro, method...) prints as a short name


def _attrs(ns: Namespace) -> dict:
    return object.__getattribute__(ns, "_Namespace__attrs")


def _items(obj: Any) -> Iterator[Any]:
    if isinstance(obj, Namespace):
        return itertools.chain.from_iterable(_attrs(obj).items())
    if isinstance(obj, dict):
        return itertools.chain.from_iterable(obj.items())
    return iter(obj)


def _overhead(obj: Any) -> int:
    if isinstance(obj, Namespace):
        return 13 + 4 * len(_attrs(obj))
    return 2 + (4 if isinstance(obj, dict) else 2) * len(obj)


_STATE: ContextVar[RenderState | None] = ContextVar("freetoken_template_render", default=None)


def current() -> RenderState:
    """The render in progress (a fresh default budget outside one, so the caps always hold)."""
    state = _STATE.get()
    return state if state is not None else RenderState(TemplateBudget())


def start(budget: TemplateBudget) -> tuple[RenderState, Any]:
    """Make `budget` the current render's; returns the state and the token for `finish`."""
    state = RenderState(budget)
    return state, _STATE.set(state)


def finish(token: Any) -> None:
    _STATE.reset(token)
