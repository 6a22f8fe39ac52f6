"""The coding recipe's test runner, run inside the sandbox as `main.py NONCE`: executes
`solution.py`, then each assert of `tests.json`, and prints NONCE only when all of them pass.

A failure ends the run with one line on stderr in the format the embedded model was trained on
(`recipes/tiny/corpus.py`): `AssertionError: f(3) returned 5, expected 7`, `SyntaxError: invalid
syntax (line 2)`, or Python's own last traceback line (`NameError: name 'a' is not defined`).
This file is copied into the sandbox and run there as a script; importing it does nothing.
"""

import ast
import json
import sys


def _describe(test: str, namespace: dict, error: AssertionError) -> str:
    """`assert CALL == EXPECTED` -> 'AssertionError: CALL returned GOT, expected EXPECTED'."""
    if error.args:
        return f"AssertionError: {error.args[0]}"
    try:
        node = ast.parse(test).body[0]
    except SyntaxError:
        return f"AssertionError: {test}"
    if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare):
        compare = node.test
        if len(compare.ops) == 1 and isinstance(compare.ops[0], ast.Eq):
            call = ast.unparse(compare.left)
            got = eval(compile(ast.Expression(compare.left), "<test>", "eval"), namespace)
            return f"AssertionError: {call} returned {got!r}, expected {ast.unparse(compare.comparators[0])}"
    return f"AssertionError: {test.removeprefix('assert ').strip()} is false"


def _fail(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.exit(1)


def main(nonce: str) -> None:
    with open("solution.py") as f:
        source = f.read()
    with open("tests.json") as f:
        tests = json.load(f)
    try:
        code = compile(source, "solution.py", "exec")
    except SyntaxError as e:
        _fail(f"SyntaxError: {e.msg} (line {e.lineno})")
    namespace: dict = {"__name__": "solution"}
    exec(code, namespace)  # an exception here ends the run with its traceback
    for test in tests:
        try:
            exec(compile(test, "<test>", "exec"), namespace)
        except AssertionError as e:
            _fail(_describe(test, namespace, e))
    sys.stdout.write(nonce + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
