"""The coding recipe's program inside the sandbox: it runs `solution.py`, then answers calls.

It never sees a test. `check_code` (`_code_judge.py`, in the trusted process) evaluates each test
itself; every name the test takes from the solution is looked up here (`describe`) and every call
of a solution function runs here (`call`), its arguments and result crossing the channel as plain
data. So the verdict is never something this process reports: code that exits early, patches
`sys.exit`, `atexit` or builtins, or prints anything has made no call return a right value, and
that is all the judge counts.

Channel: the fds in FREETOKEN_SANDBOX_CHANNEL ("READ,WRITE"), framing as in `_sandbox_channel.py`.
This process sends first: {"ready": true} once solution.py ran, or {"error": LINE} when it could
not (`SyntaxError: MSG (line N)` or the last line of the traceback, the format the embedded model
was trained on, `recipes/tiny/corpus.py`). Then, per request:

- {"op": "describe", "name": N} -> {"kind": "missing" | "callable" | "opaque", "type": T}
  | {"kind": "module", "module": M} | {"kind": "value", "value": ENCODED}
- {"op": "call", "name": N, "args": [ENCODED...], "kwargs": [[K, ENCODED]...]} -> {"value": ENCODED}
  | {"raised": {"type": T, "line": LINE}} | {"unsupported": T} (a result that is not plain data)

Plain data (`encode` / `decode`, used on both sides): None, bool, int, float and str as JSON, lists
as arrays, and objects with one key for the rest: {"tuple": [...]}, {"dict": [[k, v], ...]},
{"set": [...]}, {"frozenset": [...]}, {"bytes": HEX}, {"complex": [re, im]}. Only these exact types
(no subclasses: they could compare equal to anything) and at most `MAX_DEPTH` levels. `decode` runs
in the trusted process on what the sandbox sends, so it also bounds the work a value can cost
there: at most `MAX_ITEMS` elements in all, ints of at most `MAX_INT_BITS` bits, and set members /
dict keys only of these exact hashable types with at most `MAX_SAME_HASH` of them sharing a hash
(a set of values crafted to collide costs quadratic time to build: 1 MB of them took 18 s).

This file is copied into the sandbox and run there as `main.py`; importing it does nothing.
"""

import json
import os
import sys
import traceback

MAX_DEPTH = 64
MAX_INT_BITS = 14_000  # JSON ints go through str(): Python refuses more than 4,300 digits
MAX_ITEMS = 250_000  # elements of one decoded value, nested ones included
MAX_SAME_HASH = 8  # members of one set (keys of one dict) that may share a hash value
_TAGS = ("tuple", "dict", "set", "frozenset", "bytes", "complex")
_HASHABLE = (type(None), bool, int, float, str, bytes, complex, tuple, frozenset)


class Unsupported(TypeError):
    """A value that is not plain data (its type name is the message)."""


def encode(value, depth=0):
    """`value` as JSON-ready plain data; Unsupported for anything else."""
    if depth > MAX_DEPTH:
        raise Unsupported(f"nesting deeper than {MAX_DEPTH}")
    kind = type(value)
    if kind is int and value.bit_length() > MAX_INT_BITS:
        raise Unsupported(f"int of more than {MAX_INT_BITS} bits")
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode(v, depth + 1) for v in value]
    if kind is tuple:
        return {"tuple": [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind in (set, frozenset):
        return {kind.__name__: [encode(v, depth + 1) for v in value]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    raise Unsupported(kind.__name__)


def decode(data):
    """The value `encode` made `data` from; ValueError for anything `encode` cannot have made or
    that is over the limits above (so its cost here stays linear in its size)."""
    return _decode(data, 0, [MAX_ITEMS])


def _decode(data, depth, left):
    if depth > MAX_DEPTH:
        raise ValueError(f"nesting deeper than {MAX_DEPTH}")
    left[0] -= 1
    if left[0] < 0:
        raise ValueError(f"more than {MAX_ITEMS} elements")
    kind = type(data)
    if kind is int and data.bit_length() > MAX_INT_BITS:
        raise ValueError(f"int of more than {MAX_INT_BITS} bits")
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [_decode(v, depth + 1, left) for v in data]
    if kind is not dict or len(data) != 1 or next(iter(data)) not in _TAGS:
        raise ValueError(f"not plain data: {str(data)[:60]}")
    tag, body = next(iter(data.items()))
    if tag == "bytes":
        if type(body) is not str:
            raise ValueError("bytes must be hex text")
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError(f"{tag} needs a list")
    if tag == "complex":
        if len(body) != 2 or any(type(x) not in (int, float) for x in body):
            raise ValueError("complex needs [re, im]")
        try:
            return complex(body[0], body[1])
        except OverflowError:
            raise ValueError("complex part too large") from None
    items = [_decode(v, depth + 1, left) for v in body]
    if tag == "tuple":
        return tuple(items)
    if tag == "dict":
        if any(type(pair) is not list or len(pair) != 2 for pair in items):
            raise ValueError("dict needs [key, value] pairs")
        _check_members([k for k, _ in items], "dict key")
        return {k: v for k, v in items}
    _check_members(items, f"{tag} member")
    return set(items) if tag == "set" else frozenset(items)


def _check_members(members, what):
    """ValueError unless `members` can go into one set in linear time: each of an exact hashable
    plain type (whose hash and == are the builtins', not code's) and few sharing a hash value."""
    counts = {}
    for member in members:
        if type(member) not in _HASHABLE:
            raise ValueError(f"a {what} must be hashable plain data, not {type(member).__name__}")
        try:
            h = hash(member)
        except TypeError:  # a tuple holding a list
            raise ValueError(f"a {what} must be hashable plain data") from None
        counts[h] = counts.get(h, 0) + 1
        if counts[h] > MAX_SAME_HASH:
            raise ValueError(f"more than {MAX_SAME_HASH} {what}s with equal hashes (crafted to collide)")


def error_line(error):
    """The last line of the traceback of `error`: 'NameError: name 'a' is not defined'."""
    return traceback.format_exception_only(type(error), error)[-1].strip()


class _Channel:
    def __init__(self, spec):
        self.read_fd, self.write_fd = (int(x) for x in spec.split(","))

    def send(self, message):
        data = json.dumps(message, separators=(",", ":")).encode()
        data = len(data).to_bytes(4, "big") + data
        while data:
            data = data[os.write(self.write_fd, data) :]

    def _read(self, n):
        chunks = b""
        while len(chunks) < n:
            more = os.read(self.read_fd, n - len(chunks))
            if not more:
                return None
            chunks += more
        return chunks

    def receive(self):
        head = self._read(4)
        body = None if head is None else self._read(int.from_bytes(head, "big"))
        return None if body is None else json.loads(body.decode())


def _describe(namespace, name):
    if name not in namespace:
        return {"kind": "missing"}
    value = namespace[name]
    if type(value).__name__ == "module":
        return {"kind": "module", "module": value.__name__}
    if callable(value):
        return {"kind": "callable"}
    try:
        return {"kind": "value", "value": encode(value)}
    except Unsupported:
        return {"kind": "opaque", "type": type(value).__name__}


def _call(namespace, request):
    function = namespace.get(request["name"])
    args = [decode(a) for a in request["args"]]
    kwargs = {k: decode(v) for k, v in request["kwargs"]}
    try:
        result = function(*args, **kwargs)
    except MemoryError:
        raise  # ends the run: reported as the memory limit
    except BaseException as e:  # SystemExit and friends too: a call that does not return failed
        return {"raised": {"type": type(e).__name__, "line": error_line(e)}}
    try:
        return {"value": encode(result)}
    except Unsupported as e:
        return {"unsupported": str(e)}


def main():
    channel = _Channel(os.environ["FREETOKEN_SANDBOX_CHANNEL"])
    with open("solution.py") as f:
        source = f.read()
    try:
        code = compile(source, "solution.py", "exec")
    except SyntaxError as e:
        channel.send({"error": f"SyntaxError: {e.msg} (line {e.lineno})"})
        return
    namespace = {"__name__": "solution"}
    try:
        exec(code, namespace)
    except (SystemExit, MemoryError):
        raise  # exiting before the tests ran is reported as such
    except BaseException as e:
        traceback.print_exc()
        channel.send({"error": error_line(e)})
        return
    channel.send({"ready": True})
    while True:
        request = channel.receive()
        if request is None:
            return
        if request.get("op") == "describe":
            channel.send(_describe(namespace, request["name"]))
        else:
            channel.send(_call(namespace, request))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
