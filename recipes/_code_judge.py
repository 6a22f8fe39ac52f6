"""The trusted half of `check_code`: each test is evaluated here, in this process, and only the calls
of the solution's functions run in the sandbox (`_code_harness.py` answers them).

Why here: whatever the sandboxed process could report, the code under test could report too (it
runs in that process, can read its memory, its argv and its pipes, and can exit whenever it likes).
So the sandbox never learns a test's expected values and never reports a verdict; it returns what
the solution's functions return, as plain data, and `Judge` compares. An early exit, a patched
`sys.exit`/`atexit`/builtins or printed text leaves a test without a right value: a failure.

Tests are the caller's code (trusted, like the rest of this process): assert statements over the
solution's names. A name the test uses is asked of the sandbox first (so the solution may shadow
a builtin); functions become proxies whose calls cross the channel, plain values are copied here,
modules of the standard library are imported here. What cannot cross: objects that are not plain
data (`_code_harness.encode`), e.g. an instance of a class the solution defines, a lambda passed
as an argument. Tests that need them fail with a TypeError naming the value.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import sys
from dataclasses import dataclass
from typing import Any

from ._code_harness import Unsupported, decode, encode, error_line
from ._sandbox_channel import SandboxChannel
from .sandbox import SandboxResult

_MAX_LINE = 300  # characters of an error line; a failure note must stay one short line
_MAX_REPR = 200


class _ProgramGone(Exception):
    """The program can no longer answer: it ended, hit a limit, or broke the channel."""


class RemoteError(Exception):
    """An exception a solution function raised in the sandbox, of a type this process does not
    rebuild (not a builtin Exception); its message is the sandbox's one-line description."""


@dataclass(frozen=True)
class _Test:
    text: str
    code: Any  # compiled statement(s)
    names: tuple[str, ...]  # every name the test loads
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


def _parse(test: str) -> _Test:
    try:
        tree = ast.parse(test)
    except SyntaxError as e:
        raise ValueError(f"test {test!r} is not valid Python: {e.msg} (line {e.lineno})") from None
    names = tuple(dict.fromkeys(n.id for n in ast.walk(tree) if isinstance(n, ast.Name)))
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
    """The exception a sandboxed call raised, rebuilt here: the builtin Exception class of that name
    (so a test may catch it) or RemoteError; either way carrying the sandbox's line."""
    if not isinstance(raised, dict) or not isinstance(raised.get("type"), str):
        raise _ProgramGone("a malformed reply")
    line = _line(raised.get("line", raised["type"]))
    cls = getattr(builtins, raised["type"], None)
    error: BaseException = RemoteError(line)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            error = cls(line.partition(": ")[2])
        except TypeError:  # an exception class whose constructor wants more than a message
            pass
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
            try:
                return decode(reply["value"])
            except (ValueError, RecursionError):
                raise _ProgramGone("a malformed value") from None
        if "raised" in reply:
            raise _rebuilt(reply["raised"])
        raise TypeError(
            f"{self.name}() returned a {_line(reply.get('unsupported', '?'))}, which cannot leave the "
            f"sandbox: tests compare plain data (None, bool, int, float, complex, str, bytes, list, "
            f"tuple, dict, set)"
        )


class Judge:
    """`run_python(driver=Judge(tests))`, then `judge.result(sandbox_result)`.

    ValueError (at construction) for a test that is not valid Python."""

    def __init__(self, tests: list[str]) -> None:
        self.tests = [_parse(t) for t in tests]
        self.verdict = Verdict()
        self._channel: SandboxChannel | None = None
        self._missing: set[str] = set()  # names the solution does not define (asked once)

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self._channel is not None
        reply = self._channel.receive() if self._channel.send(message) else None
        if reply is None:
            raise _ProgramGone(self._channel.error or "no reply")
        return reply

    def __call__(self, channel: SandboxChannel) -> None:
        self._channel = channel
        hello = channel.receive()
        if hello is None:
            self.verdict = Verdict(channel=channel.error)
            return
        if "error" in hello:
            self.verdict = Verdict(False, _line(hello["error"]))
            return
        if hello.get("ready") is not True:
            self.verdict = Verdict(False, "the program sent a malformed greeting")
            return
        namespace: dict[str, Any] = {"__builtins__": builtins}
        for done, test in enumerate(self.tests):
            try:
                error = self._run(test, namespace)
            except _ProgramGone as e:
                self.verdict = Verdict(ready=True, channel=str(e), tests_passed=done)
                return
            if error is not None:
                self.verdict = Verdict(False, error, ready=True, tests_passed=done)
                return
        self.verdict = Verdict(True, ready=True, tests_passed=len(self.tests))

    def _run(self, test: _Test, namespace: dict[str, Any]) -> str | None:
        """None when `test` held, else its one-line error."""
        self._resolve(test.names, namespace)
        try:
            if test.left is not None:
                got = eval(test.left, namespace)
                expected = eval(test.right, namespace)
                if bool(got == expected):
                    return None
                return f"AssertionError: {test.call} returned {_short_repr(got)}, expected {test.expected}"
            exec(test.code, namespace)
            return None
        except _ProgramGone:
            raise
        except AssertionError as e:
            if hasattr(e, "sandbox_line"):
                return e.sandbox_line
            if e.args:
                return _line(f"AssertionError: {e.args[0]}")
            return _line(f"AssertionError: {test.text.strip().removeprefix('assert ').strip()} is false")
        except Exception as e:
            return getattr(e, "sandbox_line", None) or _line(error_line(e))

    def _resolve(self, names: tuple[str, ...], namespace: dict[str, Any]) -> None:
        """Bind each name the solution defines (asked once; a name it lacks stays a builtin or
        unbound: NameError when the test uses it)."""
        for name in names:
            if name in namespace or name in self._missing:
                continue
            reply = self.request({"op": "describe", "name": name})
            kind = reply.get("kind")
            if kind == "callable":
                namespace[name] = _Remote(self, name)
            elif kind == "value":
                try:
                    namespace[name] = decode(reply.get("value"))
                except (ValueError, RecursionError):
                    raise _ProgramGone("a malformed value") from None
            elif kind == "module" and str(reply.get("module")).partition(".")[0] in sys.stdlib_module_names:
                namespace[name] = importlib.import_module(str(reply["module"]))
            elif kind in ("module", "opaque"):
                namespace[name] = _Opaque(name, _line(reply.get("type") or f"module {reply.get('module')}"))
            elif kind == "missing":
                self._missing.add(name)
            else:
                raise _ProgramGone("a malformed reply")

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
