"""Chat templates rendered in a Jinja sandbox with a budget: what `render_chat` runs.

The environment is the one transformers' `apply_chat_template` gives a template (an
`ImmutableSandboxedEnvironment` with ``trim_blocks``/``lstrip_blocks``, loop controls, the
``{% generation %}`` tag, the `tojson` filter with its options and the globals `raise_exception`,
`strftime_now`, `dict` and `namespace`), so a real template renders byte for byte as it does
there (tests/test_template_budget.py holds every real template to that). On top of it:

- every ``for`` loop iterates through `_LoopIter` and every call, attribute and item look-up goes
  through the environment: each checks the deadline, so nested loops or endless recursion stop;
- ``* + % **``, ``~``, list/dict literals, the joins of macro and block output, and the filters,
  methods and globals of `filters`/`guards` check the size of what they would
  build before building it, and charge what they built to the render's allocation budget;
- the output is counted while it is generated;
- nothing is evaluated at compile time (no constant folding), so compiling runs no template code.

A breach, a MemoryError or RecursionError, and any error the template raises end in a one-line
`ChatTemplateError`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import ChatTemplateError
from . import filters as tf
from .budget import TEMPLATE_MAX_SOURCE_CHARS, BudgetExceeded, TemplateBudget, current, finish, start
from .guards import checked_binop, checked_concat, checked_join, guard_format, guard_method

_CONTAINERS = (list, tuple, dict, set, frozenset)


class _LoopIter:
    """What a ``for`` loop iterates: the iterable, with a deadline check per item. Keeps the
    iterable's length (a loop's ``loop.length`` reads it instead of copying the items)."""

    __slots__ = ("_items", "_length")

    def __init__(self, iterable: Any) -> None:
        self._items = iter(iterable)
        try:
            self._length = len(iterable)
        except TypeError:
            self._length = None

    def __iter__(self) -> _LoopIter:
        return self

    def __next__(self) -> Any:
        current().tick()
        return next(self._items)

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("the loop's iterable has no length")
        return self._length


class _Generator(CodeGenerator):
    """Jinja's code generator, with loops, ``~`` and literals routed through the budget."""

    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        for loop in node.find_all(nodes.For):
            wrap = nodes.Call(nodes.EnvironmentAttribute("ft_loop"), [loop.iter], [], None, None)
            loop.iter = wrap.set_lineno(loop.iter.lineno).set_environment(self.environment)
        super().visit_Template(node, frame)

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile:
            autoescape = "context.eval_ctx.autoescape"
        else:
            autoescape = "True" if frame.eval_ctx.autoescape else "False"
        self.write("environment.ft_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(f"), {autoescape})")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self.write("environment.ft_literal(")
        super().visit_List(node, frame)
        self.write(")")

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self.write("environment.ft_literal(")
        super().visit_Dict(node, frame)
        self.write(")")

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx != "load":  # an assignment target, not a value
            super().visit_Tuple(node, frame)
            return
        self.write("environment.ft_literal(")
        super().visit_Tuple(node, frame)
        self.write(")")


class _GenerationTag(Extension):
    """transformers' ``{% generation %}...{% endgeneration %}``: marks the assistant's text for its
    token masks; the text renders unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


@jinja2.pass_context
def _finalize(context: Any, value: Any) -> Any:
    """Each ``{{ value }}``: a non-string is measured before it is printed."""
    state = current()
    if isinstance(value, str):
        state.charge(len(value))
    else:
        size = state.measure(value)
        state.value(size)
        state.charge(size)
    return value


def _charging_filter(name: str, fn: Callable) -> Callable:
    """`fn` with its input measured (if it prints it) and its new result charged."""
    selector = name in tf.SELECTOR_FILTERS
    printing = name not in tf.STRUCTURAL_FILTERS
    passes = hasattr(fn, "jinja_pass_arg")  # a context/eval context/environment comes first

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        state = current()
        state.tick()
        value = args[1 if passes else 0] if len(args) > passes else None
        if printing and not isinstance(value, (str, int, float)) and value is not None:
            state.value(state.measure(value))
        result = fn(*args, **kwargs)
        if not selector and not any(result is a for a in args):
            state.charge(_built(result))
        return result

    return checked


def _built(value: Any) -> int:
    if isinstance(value, (str, bytes, bytearray, *_CONTAINERS)):
        return len(value)
    return 0


def _lookup(obj: Any) -> bool:
    """A container's method that returns what the container holds (``get``, ``items``...)."""
    owner = getattr(obj, "__self__", None)
    return isinstance(owner, _CONTAINERS) and getattr(obj, "__name__", "") != "copy"


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment, with the budget checks (see the module)."""

    code_generator_class = _Generator
    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, loopcontrols],
            finalize=_finalize,
            optimized=False,  # constant folding would run filters while compiling
        )
        self.concat = checked_join  # type: ignore[assignment]  # macro, block and set-block output
        self.filters.update(tf.GUARDED_FILTERS)
        self.filters = {name: _charging_filter(name, fn) for name, fn in self.filters.items()}
        self.globals.update(
            lipsum=tf.lipsum,
            raise_exception=tf.raise_exception,
            strftime_now=tf.strftime_now,
            dict=tf.TemplateDict(),
            namespace=tf.TemplateNamespace,
        )

    # hooks of the generated code (environment attributes, out of the template's reach)
    @staticmethod
    def ft_loop(iterable: Any) -> _LoopIter:
        return _LoopIter(iterable)

    @staticmethod
    def ft_concat(values: tuple, autoescape: bool) -> str:
        return checked_concat(values, autoescape)

    @staticmethod
    def ft_literal(value: Any) -> Any:
        state = current()
        state.value(state.measure(value))
        state.charge(len(value))
        return value

    # the sandbox's own hooks
    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        return checked_binop(current(), operator, left, right, self.binop_table[operator])

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        state = current()
        state.tick()
        result = super().call(context, obj, *args, **kwargs)
        if not _lookup(obj) and result is not getattr(obj, "__self__", None):
            size = _built(result)
            if isinstance(result, (list, tuple)):  # str.split and the like: new strings too
                size += sum(len(x) for x in result if isinstance(x, (str, bytes)))
            state.charge(size)
        return result

    def getattr(self, obj: Any, attribute: str) -> Any:
        current().tick()
        return guard_method(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        state = current()
        state.tick()
        value = super().getitem(obj, argument)
        if isinstance(argument, slice):
            state.charge(_built(value))
        return guard_method(value)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        return None if wrapped is None else guard_format(value, wrapped)


_ENVIRONMENT = BudgetedEnvironment()


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    return _ENVIRONMENT.from_string(source)


def render_template(source: str, variables: Mapping[str, Any], budget: TemplateBudget | None = None) -> str:
    """`source` rendered with `variables` within `budget` (default: the module defaults of
    `budget`). ChatTemplateError, one line, when the template refuses its input, breaks
    the budget or fails."""
    budget = budget or TemplateBudget()
    if len(source) > TEMPLATE_MAX_SOURCE_CHARS:
        raise ChatTemplateError(
            f"the chat template is over {TEMPLATE_MAX_SOURCE_CHARS} characters long "
            "(TEMPLATE_MAX_SOURCE_CHARS)"
        )
    state, token = start(budget)
    try:
        return _generate(_compile(source), variables, state.budget.max_chars)
    except BudgetExceeded as e:
        raise ChatTemplateError(str(e)) from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template refused the messages: {_line(e)}") from None
    except MemoryError:
        raise ChatTemplateError("the chat template ran out of memory while rendering") from None
    except RecursionError:
        raise ChatTemplateError("the chat template nested too deeply (Python's recursion limit)") from None
    except Exception as e:  # the template's own error (a bad operand, a missing key...)
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {_line(e)}") from None
    finally:
        finish(token)


def _generate(template: jinja2.Template, variables: Mapping[str, Any], limit: int) -> str:
    pieces: list[str] = []
    size = 0
    stream: Iterable[str] = template.generate(**variables)
    try:
        for piece in stream:
            size += len(piece)
            if size > limit:
                raise BudgetExceeded(f"the chat template wrote over {limit} characters (TEMPLATE_MAX_CHARS)")
            pieces.append(piece)
    finally:
        stream.close()  # type: ignore[attr-defined]
    return "".join(pieces)


def _line(error: BaseException) -> str:
    """The error's message on one line, at most 300 characters (a template chooses it)."""
    line = " ".join(str(error).split()) or type(error).__name__
    return line if len(line) <= 300 else line[:297] + "..."
