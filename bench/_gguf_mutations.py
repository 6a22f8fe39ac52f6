"""The mutations of `bench/fuzz_gguf.py` and its in-process, reader-only runner (`read_cases`, which
tests/test_gguf_hostile.py runs): a valid GGUF's numeric fields located (`fields`), then changed
by kind (`mutate`): header counts, metadata array counts and item types, string lengths, value
types, tensor directory fields, tensor data, truncations, bit flips, swapped fields, metadata
values. A case is determined by its ``random.Random`` (seeded ``"seed:i"``)."""

from __future__ import annotations

import os
import random
import struct
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READER_KINDS = ("header", "array", "string", "kv_type", "tensor_info", "data", "truncate", "bitflip", "swap")
KINDS = (*READER_KINDS, "value")
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class Field:
    """One numeric field of a valid GGUF: where it lies, its struct code and what it is."""

    offset: int
    code: str
    kind: str  # a mutation kind of KINDS
    label: str


@dataclass
class Outcome:
    case: str
    kind: str
    detail: str
    status: str  # ok | named | raw | hang | crash | memory
    error: str = ""
    message: str = ""
    where: str = ""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    partial: str = ""


def fields(data: bytes) -> tuple[list[Field], int]:
    """Every numeric field of the valid GGUF `data`, and where its tensor data starts."""
    out: list[Field] = []
    pos = 0

    def num(code: str, kind: str, label: str) -> int:
        nonlocal pos
        out.append(Field(pos, code, kind, label))
        (value,) = struct.unpack_from("<" + code, data, pos)
        pos += struct.calcsize(code)
        return value

    def string(label: str) -> None:
        nonlocal pos
        n = num("Q", "string", f"length of {label}")
        pos += n

    pos = 4
    num("I", "header", "version")
    n_tensors, n_kv = num("Q", "header", "tensor count"), num("Q", "header", "metadata count")
    for i in range(n_kv):
        key_at = pos
        string(f"key {i}")
        key = data[key_at + 8 : pos].decode()
        vtype = num("I", "kv_type", f"type of {key}")
        if vtype == 9:
            itype = num("I", "array", f"item type of {key}")
            count = num("Q", "array", f"length of {key}")
            for j in range(count):
                if itype == 8:
                    string(f"item {j} of {key}")
                else:
                    pos += struct.calcsize(_SCALAR[itype])
        elif vtype == 8:
            string(f"value of {key}")
        else:
            num(_SCALAR[vtype], "value", key)
    for i in range(n_tensors):
        string(f"name of tensor {i}")
        n_dims = num("I", "tensor_info", f"dim count of tensor {i}")
        for d in range(n_dims):
            num("Q", "tensor_info", f"dim {d} of tensor {i}")
        num("I", "tensor_info", f"type of tensor {i}")
        num("Q", "tensor_info", f"offset of tensor {i}")
    return out, -(-pos // 32) * 32


_INTS = (0, 1, 2, 3, 7, 8, 9, 13, 31, 32, 33, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40)
_INTS += (2**62, 2**63 - 1, 2**63, 2**64 - 1)
_FLOATS = (0.0, -1.0, 1e-45, 1e30, 3.4e38, float("inf"), float("-inf"), float("nan"))


def _interesting(f: Field, old: int | float, rng: random.Random) -> int | float:
    if f.code in "fd":
        return rng.choice(_FLOATS)
    if f.code == "?":
        return rng.choice((False, True))
    bits = struct.calcsize(f.code) * 8
    value = rng.choice((*_INTS, old + 1, old - 1, old * 2, old // 2, old + rng.randrange(-64, 65)))
    value %= 2**bits
    return value - 2**bits if f.code.islower() and value >= 2 ** (bits - 1) else value


def _put(buf: bytearray, f: Field, value: int | float) -> None:
    struct.pack_into("<" + f.code, buf, f.offset, value)


def mutate(data: bytes, kind: str, rng: random.Random) -> tuple[bytes, str]:
    """A mutation of kind `kind` of the valid GGUF `data`: (the bytes, a one-line description)."""
    flds, data_start = fields(data)
    buf = bytearray(data)
    if kind in ("header", "array", "string", "kv_type", "tensor_info", "value"):
        f = rng.choice([f for f in flds if f.kind == kind])
        (old,) = struct.unpack_from("<" + f.code, data, f.offset)
        value = rng.randrange(0, 20) if kind in ("kv_type",) else _interesting(f, old, rng)
        if kind == "array" and f.label.startswith("item type"):
            value = rng.randrange(0, 16)
        _put(buf, f, value)
        return bytes(buf), f"{f.label}: {old!r} -> {value!r}"
    if kind == "data":
        n = rng.choice((1, 2, 8, 64, 4096))
        at = rng.randrange(data_start, len(buf))
        chunk = bytes(rng.choice((0, 0xFF, rng.randrange(256))) for _ in range(min(n, len(buf) - at)))
        buf[at : at + len(chunk)] = chunk
        return bytes(buf), f"{len(chunk)} data bytes at {at}"
    if kind == "truncate":
        cuts = [f.offset + rng.randrange(0, 8) for f in flds] + [data_start, rng.randrange(len(buf))]
        cut = min(rng.choice(cuts), len(buf) - 1)
        return bytes(buf[:cut]), f"cut at byte {cut} of {len(buf)}"
    if kind == "bitflip":
        bits = [rng.randrange(data_start * 8) for _ in range(rng.choice((1, 1, 2, 4, 16)))]
        for b in bits:
            buf[b // 8] ^= 1 << (b % 8)
        return bytes(buf), f"bits {bits[:4]}{'...' if len(bits) > 4 else ''} flipped"
    if kind == "swap":
        a = rng.choice(flds)
        same = [f for f in flds if f.code == a.code and f != a] or [a]
        b = rng.choice(same)
        va, vb = (struct.unpack_from("<" + f.code, data, f.offset)[0] for f in (a, b))
        _put(buf, a, vb)
        _put(buf, b, va)
        return bytes(buf), f"swapped {a.label} ({va!r}) and {b.label} ({vb!r})"
    raise ValueError(f"unknown mutation kind {kind!r}")


def _where(e: BaseException) -> str:
    """The innermost frame of the repository's own code (else the innermost frame) of `e`."""
    frames = traceback.extract_tb(e.__traceback__)
    own = [f for f in frames if str(REPO) in f.filename and "/bench/" not in f.filename] or frames
    f = own[-1] if own else None
    return "" if f is None else f"{os.path.relpath(f.filename, REPO)}:{f.lineno} ({f.name})"


def classify(e: BaseException) -> tuple[str, str, str, str]:
    from freetoken_agents.engine.errors import EngineError

    msg = " ".join(str(e).split())[:300]
    status = "named" if isinstance(e, EngineError) else "raw"
    return status, type(e).__name__, msg, "" if status == "named" else _where(e)


def read_cases(
    base: bytes, folder: Path, *, seed: int, count: int, kinds: tuple[str, ...] = READER_KINDS
) -> list[Outcome]:
    """`count` cases read in-process by the reader alone: `GGUFSource` plus every tensor decoded."""
    from freetoken_agents.engine.loading.gguf import GGUFSource
    from freetoken_agents.engine.loading.gguf.reader import dequantize

    out = []
    for i in range(count):
        rng = random.Random(f"{seed}:{i}")
        kind = kinds[i % len(kinds)]  # every kind, in turn
        data, detail = mutate(base, kind, rng)
        path = folder / f"case{i}.gguf"
        path.write_bytes(data)
        o = Outcome(f"{seed}:{i}", kind, detail, "ok")
        try:
            src = GGUFSource(path)
            for t in src.tensors.values():
                dequantize(t, path)
        except Exception as e:  # what the reader raised: named or not, the test judges it
            o.status, o.error, o.message, o.where = classify(e)
        path.unlink()
        out.append(o)
    return out
