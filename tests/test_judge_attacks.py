"""The coding recipe's judge against solutions that attack it (security review findings): names the
sandbox sends back, redefined builtins, tests read from a command line, costly values, malformed
replies. Each runs through the real `check_code` at every isolation level this machine has."""

from __future__ import annotations

import sys

import pytest
from test_sandbox import MODES

from freetoken_agents.recipes import _code_judge
from freetoken_agents.recipes.coding_solver import check_code

TESTS = ["assert inc(1) == 2", "assert inc(41) == 42"]
RIGHT = "def inc(x):\n    return x + 1\n"

# A solution function that answers its call with raw bytes on the channel instead of the harness's
# reply (what any solution can do: the channel is in its process), then ends.
RAW_REPLY = """
import json, os
def inc(x):
    fd = int(os.environ["FREETOKEN_SANDBOX_CHANNEL"].split(",")[1])
    data = json.dumps(REPLY).encode()
    os.write(fd, len(data).to_bytes(4, "big") + data)
    os._exit(0)
"""
COLLIDING = "{'value': {'set': [k * (2**61 - 1) for k in range(38000)]}}"  # ~1 MB, all hash 0


def raw(reply: str) -> str:
    return f"REPLY = {reply}\n{RAW_REPLY}"


# ---- names the sandbox sends back are never imported or called ----------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_judge_never_imports_a_module_the_sandbox_names(mode):
    # the old judge imported venv.__main__ here: venv's CLI ran on pytest's argv and raised SystemExit
    code = 'import types\ninc = types.ModuleType("venv.__main__")\n'
    result = check_code(code, TESTS, isolation=mode)
    assert not result.passed and result.error.startswith("TypeError: inc is a module in the sandbox")
    assert "venv.__main__" not in sys.modules


@pytest.mark.parametrize("module", ["os.no_such_module", "math.\x00", "", "antigravity"])
def test_judge_a_bad_module_name_is_a_verdict_not_an_exception(module):
    code = f"import types\ninc = types.ModuleType({module!r})\n"
    result = check_code(code, TESTS)  # the old judge raised ModuleNotFoundError / ValueError here
    assert not result.passed and "inc is a module in the sandbox" in result.error


def test_judge_module_names_in_tests_mean_this_processs_own_modules():
    # the solution's `math` claims to be `this` (which prints on import); the test's `math` is math
    code = 'import types\nmath = types.ModuleType("this")\n' + RIGHT
    assert check_code(code, ["assert inc(1) == 2 and math.floor(2.5) == 2"]).passed
    assert "this" not in sys.modules
    honest = "import math\ndef area(r):\n    return math.pi * r * r\n"
    assert check_code(honest, ["assert area(1) == math.pi"]).passed
    exotic = "import venv\ndef f():\n    return 1\n"  # not a module tests may use: opaque, not imported
    result = check_code(exotic, ["assert f() == 1 and venv.main() is None"])
    assert not result.passed and "venv is a module in the sandbox" in result.error


def test_judge_exception_types_are_rebuilt_from_a_fixed_table():
    result = check_code(raw("{'raised': {'type': 'SystemExit', 'line': 'SystemExit: 0'}}"), TESTS)
    assert not result.passed and result.error == "SystemExit: 0"
    caught = "try:\n    inc(1)\nexcept ValueError as e:\n    assert str(e) == 'bad'"
    assert check_code(raw("{'raised': {'type': 'ValueError', 'line': 'ValueError: bad'}}"), [caught]).passed


# ---- builtins in tests are this process's real builtins -----------------------------------------
SHADOWS = {
    "sorted": (
        "def sorted(xs, **kw):\n    return [1, 2, 3]\n",
        "assert sorted(shuffle([3, 1, 2])) == [1, 2, 3]",
    ),
    "len": ("def len(xs):\n    return 3\n", "assert len(shuffle([1, 1, 2])) == 3"),
    "abs": ("def abs(x):\n    return 3\n", "assert abs(shuffle(-3)) == 3"),
    "round": ("def round(x, n=None):\n    return 2\n", "assert round(shuffle(2.5)) == 2"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("builtin", sorted(SHADOWS))
def test_judge_a_solution_cannot_redefine_the_builtins_tests_call(mode, builtin):
    # `shuffle` should return its argument; this one returns 0 and the redefined builtin hid that
    redefinition, test = SHADOWS[builtin]
    result = check_code("def shuffle(x):\n    return 0\n" + redefinition, [test], isolation=mode)
    assert not result.passed  # the old judge: PASS at both levels
    assert result.error.startswith(("TypeError", "AssertionError: "))
    assert check_code("def shuffle(x):\n    return x\n" + redefinition, [test], isolation=mode).passed


def test_judge_builtins_and_names_the_test_binds_are_never_asked_of_the_sandbox():
    judge = _code_judge.Judge(["import math\nxs = [abs(v) for v in inc(1)]\nassert sorted(xs) == xs"])
    assert judge.tests[0].names == ("inc",)


# ---- values the sandbox sends are decoded under limits ------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_judge_refuses_a_set_of_colliding_hashes(mode):
    # the old judge built this set in the trusted process: 18 s against a 5 s limit
    result = check_code(raw(COLLIDING), TESTS, isolation=mode)
    assert not result.passed
    assert "inc() returned a value the judge refuses" in result.error and "equal hashes" in result.error


def test_judge_a_refused_value_cannot_be_caught_by_the_tests_own_code():
    swallow = "try:\n    inc(1)\nexcept Exception:\n    pass"
    result = check_code(raw(COLLIDING), [swallow])
    assert not result.passed and "equal hashes" in result.error


@pytest.mark.parametrize(
    "reply, words",
    [
        ("{'value': {'set': [[1]]}}", "must be hashable plain data"),
        ("{'value': {'dict': [[{'tuple': [[1]]}, 1]]}}", "must be hashable plain data"),
        ("{'value': [0] * 300000}", "more than 250000 elements"),
        ("{'value': {'complex': [10**400, 0]}}", "complex part too large"),
        ("{'value': {'bogus': 1}}", "not plain data"),
        ("{'raised': 'no dict'}", "malformed reply"),
    ],
)
def test_judge_malformed_or_costly_replies_are_failed_verdicts(reply, words):
    result = check_code(raw(reply), TESTS)
    assert not result.passed and words in result.error


def test_judge_a_bad_name_lookup_reply_is_a_failed_verdict():
    code = """
import json, os
fd = int(os.environ["FREETOKEN_SANDBOX_CHANNEL"].split(",")[1])
for message in ({"ready": True}, {"kind": "module", "module": 7}, {"kind": ["?"]}):
    data = json.dumps(message).encode()
    os.write(fd, len(data).to_bytes(4, "big") + data)
read_fd = int(os.environ["FREETOKEN_SANDBOX_CHANNEL"].split(",")[0])
while os.read(read_fd, 4096):  # until the judge hangs up
    pass
"""
    result = check_code(code, ["assert inc(1) == 2"])
    assert (
        not result.passed
        and result.error == "TypeError: inc is a module in the sandbox; tests can use its functions only"
    )
    result = check_code(code, ["assert x == 1 and inc(1) == 2"])  # x: a module; inc: a malformed kind
    assert not result.passed and "malformed reply to a name lookup" in result.error


def test_judge_a_check_over_the_time_budget_fails(monkeypatch):
    monkeypatch.setattr(_code_judge, "CHECK_BUDGET_S", -1.0)  # any check is over a negative budget
    result = check_code(RIGHT, TESTS)
    assert not result.passed and result.error.startswith("TimeoutError: checking this test's values took")


@pytest.mark.parametrize("mode", MODES)
def test_judge_honest_solutions_still_pass_and_wrong_ones_say_why(mode):
    code = "def group(xs):\n    return {x % 2: {y for y in xs if y % 2 == x % 2} for x in xs}\n" + RIGHT
    tests = ["assert group([1]) == {1: {1}}", "assert len(group([1, 2])) == 2", *TESTS]
    assert check_code(code, tests, isolation=mode).passed
    wrong = check_code("def inc(x):\n    return x\n", TESTS, isolation=mode)
    assert not wrong.passed and wrong.error == "AssertionError: inc(1) returned 1, expected 2"
