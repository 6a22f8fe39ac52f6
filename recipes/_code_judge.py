"""The trusted half of `check_code`: each test is evaluated here, in this process, and only the calls
of the solution's functions run in the sandbox (`_code_harness.py` answers them).

Why here: whatever the sandboxed process could report, the code under test could report too (it
runs in that process, can read its memory, its argv and its pipes, and can exit whenever it likes).
So the sandbox never learns a test's expected values and never reports a verdict; it returns what
the solution's functions return, as plain data, and `Judge` compares. An early exit, a patched
`sys.exit`/`atexit`/builtins or printed text leaves a test without a right value: a failure.

Tests are the caller's code (trusted, like the rest of this process): assert statements over the
solution's names. The verdict is computed from data only: nothing the sandbox names is imported or
called here. A name the test uses that is a Python builtin is always this process's real builtin
(a solution that redefines `sorted` or `len` cannot change what the test computes); a name the
test binds itself (an import, a loop variable) is its own; every other name is asked of the
sandbox: functions become proxies whose calls cross the channel, plain values are decoded here
under `decode`'s limits, a module becomes this process's own module of that name only when the
test's name is one of `_MODULES` (pure standard-library modules), else an opaque stand-in. What
cannot cross: objects that are not plain data (`_code_harness.encode`), e.g. an instance of a
class the solution defines, a lambda passed as an argument. Tests that need them fail with a
TypeError naming the value. Whatever comes back (a malformed reply, a value over the limits, a
check that takes more than `CHECK_BUDGET_S` here) is a failed verdict, never an exception.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from ._code_harness import Unsupported, decode, encode, error_line
from ._sandbox_channel import SandboxChannel
from .sandbox import SandboxResult

logger = logging.getLogger(__name__)

_MAX_LINE = 300  # characters of an error line; a failure note must stay one short line
_MAX_REPR = 200
CHECK_BUDGET_S = 2.0  # seconds this process may spend on one test's values (decoding, comparing)

# The only modules a test may use through a solution's `import`: pure, side-effect-free standard
# library modules, imported here by the test's own name (never by a name the sandbox sends).
_MODULES = frozenset(
    "math cmath string re itertools functools operator collections fractions decimal statistics "
    "heapq bisect".split()
)
_BUILTINS = frozenset(dir(builtins))
# Exceptions a sandboxed call may raise that are rebuilt here as themselves (so a test may catch
# them); any other type name becomes RemoteError. A fixed table: the sandbox names a type, this
# process never looks that name up.
_REBUILT: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        Exception,
        ArithmeticError,
        AssertionError,
        AttributeError,
        IndexError,
        KeyError,
        LookupError,
        NameError,
        NotImplementedError,
        OverflowError,
        RecursionError,
        RuntimeError,
        TypeError,
        UnboundLocalError,
        ValueError,
        ZeroDivisionError,
    )
}


class _Stop(BaseException):
    """Ends the tests (a BaseException, so a test's own `except Exception` cannot swallow it)."""


class _ProgramGone(_Stop):
    """The program can no longer answer: it ended, hit a limit, or broke the channel."""


class _Refused(_Stop):
    """The program's reply is malformed or costs too much to use here: the run fails with its line."""


class RemoteError(Exception):
    """An exception a solution function raised in the sandbox, of a type this process does not
    rebuild (see `_REBUILT`); its message is the sandbox's one-line description."""


@dataclass(frozen=True)
class _Test:
    text: str
    code: Any  # compiled statement(s)
    names: tuple[str, ...]  # the names to ask the sandbox for (loaded, not builtins, not bound here)
    left: Any = None  # `assert LEFT == RIGHT` (no message): compiled LEFT and RIGHT, evaluated once
    right: Any = None
    call: str = ""
    expected: str = ""


@dataclass(frozen=True)
class Verdict:
    """What the judge found. `passed`: every test held. `error`: the first failure's one-line error;
    None when the program went away first: `ready` says whether it got as far as the tests,
    `channel` why it stopped answering."""

    passed: bool = False
    error: str | None = None
    ready: bool = False
    channel: str | None = None
    tests_passed: int = 0


def _bound(tree: ast.AST) -> set[str]:
    """Names the test binds itself (assignments, imports, loop and exception variables...)."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.alias):
            bound.add(node.asname or node.name.partition(".")[0])
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
    return bound


def _parse(test: str) -> _Test:
    try:
        tree = ast.parse(test)
    except SyntaxError as e:
        raise ValueError(f"test {test!r} is not valid Python: {e.msg} (line {e.lineno})") from None
    skip = _bound(tree) | _BUILTINS
    loaded = (n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))
    names = tuple(name for name in dict.fromkeys(loaded) if name not in skip)
    code = compile(tree, "<test>", "exec")
    node = tree.body[0] if len(tree.body) == 1 else None
    if isinstance(node, ast.Assert) and node.msg is None and isinstance(node.test, ast.Compare):
        compare = node.test
        if len(compare.ops) == 1 and isinstance(compare.ops[0], ast.Eq):
            left, right = compare.left, compare.comparators[0]
            return _Test(
                test,
                code,
                names,
                compile(ast.Expression(left), "<test>", "eval"),
                compile(ast.Expression(right), "<test>", "eval"),
                ast.unparse(left),
                ast.unparse(right),
            )
    return _Test(test, code, names)


def _line(text: object) -> str:
    """An untrusted error line, made one short line of text."""
    line = " ".join(str(text).split())
    return line if len(line) <= _MAX_LINE else line[: _MAX_LINE - 3] + "..."


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 3] + "..."


def _rebuilt(raised: object) -> BaseException:
    """The exception a sandboxed call raised, rebuilt here from data: the builtin class of that
    name when `_REBUILT` has it (so a test may catch it), else RemoteError; either way carrying
    the sandbox's line."""
    if not isinstance(raised, dict) or not isinstance(raised.get("type"), str):
        raise _Refused("the program sent a malformed reply (an exception without a type)")
    line = _line(raised.get("line", raised["type"]))
    cls = _REBUILT.get(raised["type"])
    error: BaseException = RemoteError(line) if cls is None else cls(line.partition(": ")[2])
    error.sandbox_line = line  # type: ignore[attr-defined]
    return error


class _Opaque:
    """A solution name that cannot cross the channel (an object that is not plain data)."""

    def __init__(self, name: str, what: str) -> None:
        self.name, self.what = name, what

    def __repr__(self) -> str:
        return f"<{self.what} {self.name} in the sandbox>"

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise TypeError(f"{self.name} is a {self.what} in the sandbox; tests can use its functions only")

    def __getattr__(self, attr: str) -> object:
        raise AttributeError(f"{self.name} is a {self.what} in the sandbox; tests cannot use its {attr}")


class _Remote:
    """A solution function: calling it runs it in the sandbox with plain-data arguments."""

    def __init__(self, judge: Judge, name: str) -> None:
        self.judge, self.name = judge, name

    def __repr__(self) -> str:
        return f"<function {self.name} in the sandbox>"

    def __call__(self, *args: object, **kwargs: object) -> object:
        try:
            request = {
                "op": "call",
                "name": self.name,
                "args": [encode(a) for a in args],
                "kwargs": [[k, encode(v)] for k, v in kwargs.items()],
            }
        except Unsupported as e:
            message = f"cannot pass a {e} to {self.name}() in the sandbox (only plain data crosses)"
            raise TypeError(message) from None
        reply = self.judge.request(request)
        if "value" in reply:
            return self.judge.decode(reply["value"], f"{self.name}() returned")
        if "raised" in reply:
            raise _rebuilt(reply["raised"])
        raise TypeError(
            f"{self.name}() returned a {_line(reply.get('unsupported', '?'))}, which cannot leave the "
            f"sandbox: tests compare plain data (None, bool, int, float, complex, str, bytes, list, "
            f"tuple, dict, set)"
        )


class Judge:
    """`run_python(driver=Judge(tests))`, then `judge.result(sandbox_result)`.

    ValueError (at construction) for a test that is not valid Python; after that nothing the
    program does makes the judge raise: every failure is a Verdict."""

    def __init__(self, tests: list[str]) -> None:
        self.tests = [_parse(t) for t in tests]
        self.verdict = Verdict()
        self._channel: SandboxChannel | None = None
        self._missing: set[str] = set()  # names the solution does not define (asked once)
        self._stop: _Stop | None = None  # the first stop, kept even if a test caught it
        self._started = 0.0  # when the current test began, and the time it spent waiting for replies
        self._waited = 0.0

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self._channel is not None
        if self._stop is not None:
            raise self._stop
        began = time.perf_counter()
        reply = self._channel.receive() if self._channel.send(message) else None
        self._waited += time.perf_counter() - began
        if reply is None:
            raise self._stopping(_ProgramGone(self._channel.error or "no reply"))
        return reply

    def decode(self, data: object, what: str) -> object:
        """A value the program sent, decoded under `decode`'s limits and this test's time budget."""
        try:
            value = decode(data)
        except (ValueError, RecursionError) as e:
            raise self._stopping(_Refused(f"{what} a value the judge refuses: {e}")) from None
        self._check_budget()
        return value

    def _stopping(self, stop: _Stop) -> _Stop:
        self._stop = self._stop or stop
        return self._stop

    def _check_budget(self) -> None:
        spent = time.perf_counter() - self._started - self._waited
        if spent > CHECK_BUDGET_S:
            raise self._stopping(
                _Refused(
                    f"TimeoutError: checking this test's values took {spent:.1f} s here, over the "
                    f"judge's {CHECK_BUDGET_S:g} s budget (a value too large or too slow to compare)"
                )
            )

    def __call__(self, channel: SandboxChannel) -> None:
        self._channel = channel
        try:
            self.verdict = self._judge(channel)
        except Exception as e:  # a reply shaped in a way no check above foresaw: still a verdict
            logger.warning("judge: a reply it could not use", exc_info=True)
            self.verdict = Verdict(False, _line(f"the judge could not use the program's replies: {e!r}"))

    def _judge(self, channel: SandboxChannel) -> Verdict:
        hello = channel.receive()
        if hello is None:
            return Verdict(channel=channel.error)
        if "error" in hello:
            return Verdict(False, _line(hello["error"]))
        if hello.get("ready") is not True:
            return Verdict(False, "the program sent a malformed greeting")
        namespace: dict[str, Any] = {"__builtins__": builtins}
        for done, test in enumerate(self.tests):
            try:
                error = self._run(test, namespace)
            except _ProgramGone as e:
                return Verdict(ready=True, channel=str(e), tests_passed=done)
            except _Refused as e:
                return Verdict(False, _line(e), ready=True, tests_passed=done)
            if error is not None:
                return Verdict(False, error, ready=True, tests_passed=done)
        return Verdict(True, ready=True, tests_passed=len(self.tests))

    def _run(self, test: _Test, namespace: dict[str, Any]) -> str | None:
        """None when `test` held, else its one-line error; _Stop when the program stopped
        answering or sent what the judge refuses (even if the test's own code caught it)."""
        self._started, self._waited = time.perf_counter(), 0.0
        self._resolve(test.names, namespace)
        try:
            error = self._evaluate(test, namespace)
        except _Stop:
            raise
        except AssertionError as e:
            if hasattr(e, "sandbox_line"):
                error = e.sandbox_line
            elif e.args:
                error = _line(f"AssertionError: {e.args[0]}")
            else:
                error = _line(f"AssertionError: {test.text.strip().removeprefix('assert ').strip()} is false")
        except Exception as e:
            error = getattr(e, "sandbox_line", None) or _line(error_line(e))
        if self._stop is not None:
            raise self._stop
        self._check_budget()
        return error

    def _evaluate(self, test: _Test, namespace: dict[str, Any]) -> str | None:
        if test.left is None:
            exec(test.code, namespace)
            return None
        got = eval(test.left, namespace)
        expected = eval(test.right, namespace)
        if bool(got == expected):
            return None
        self._check_budget()
        return f"AssertionError: {test.call} returned {_short_repr(got)}, expected {test.expected}"

    def _resolve(self, names: tuple[str, ...], namespace: dict[str, Any]) -> None:
        """Bind each name the solution defines (asked once; a name it lacks stays unbound:
        NameError when the test uses it). Builtins and names the test binds are never asked."""
        for name in names:
            if name in namespace or name in self._missing:
                continue
            reply = self.request({"op": "describe", "name": name})
            kind = reply.get("kind")
            if kind == "callable":
                namespace[name] = _Remote(self, name)
            elif kind == "value":
                namespace[name] = self.decode(reply.get("value"), f"{name} is")
            elif kind == "module" and name in _MODULES:
                namespace[name] = importlib.import_module(name)  # the test's name, from a fixed list
            elif kind in ("module", "opaque"):
                namespace[name] = _Opaque(name, "module" if kind == "module" else _line(reply.get("type")))
            elif kind == "missing":
                self._missing.add(name)
            else:
                raise self._stopping(_Refused("the program sent a malformed reply to a name lookup"))

    def result(self, run: SandboxResult) -> SandboxResult:
        """`run` (the sandbox's account of the program) with the judge's verdict: passed only when
        every test held and no limit hit."""
        v = self.verdict
        if v.passed and run.killed_by_limit is None:
            return run.model_copy(update={"passed": True, "error": None})
        if run.killed_by_limit is not None:
            error = run.error
        elif v.error is not None:
            error = v.error
        elif run.returncode not in (0, None) and run.error:
            error = run.error
        else:
            error = f"the program exited {'while' if v.ready else 'before'} its tests ran"
        return run.model_copy(update={"passed": False, "error": error})
