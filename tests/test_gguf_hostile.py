"""Hostile GGUF files (issue 59, items 4 and 6): every structural lie is one `CheckpointError` line
naming the file before anything loops or allocates, a file truncated while it converts is an error
(never a SIGBUS), and the conversion cache keeps no partial file. The seeded fuzz of
`bench/fuzz_gguf.py` runs a few dozen cases here too (its mutations: bench/_gguf_mutations.py)."""

from __future__ import annotations

import contextlib
import signal
import struct
import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from filelock import FileLock
from gguf_models import write_gguf

from freetoken_agents.engine import Engine
from freetoken_agents.engine.errors import CheckpointError
from freetoken_agents.engine.loading.cache import cached_ftw
from freetoken_agents.engine.loading.gguf import GGUFSource, convert_gguf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import _gguf_mutations as fuzz_gguf  # noqa: E402  (bench/: the fuzzer's mutations, in-process runner)

U8, U32, STR, ARR = 0, 4, 8, 9


def _str(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _kv(key: bytes, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _head(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _tensor(name: bytes, dims: tuple[int, ...], qtype: int = 0, offset: int = 0) -> bytes:
    return _str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, qtype, offset)


ARCH = _kv(b"general.architecture", STR, _str(b"qwen3moe"))


def _file(tensors: list[bytes], data: bytes = b"", kvs: tuple[bytes, ...] = (ARCH,)) -> bytes:
    body = _head(len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    return body + b"\0" * (-len(body) % 32) + data


class _Hung(BaseException):
    """Not an Exception: the fuzz loop's ``except Exception`` must not swallow it."""


@contextlib.contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """A safety net, not a timing: a regression that loops (gguf-py's reader on a huge count does,
    growing memory) fails with `_Hung` instead of hanging the suite."""

    def hung(signum: int, frame: object) -> None:
        raise _Hung(f"still reading after {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def hostile_121_bytes() -> bytes:
    """The reviewer's file: one uint8 metadata array claiming 2**40 items, in 121 bytes."""
    body = _head(0, 1) + _kv(b"tokenizer.ggml.tokens", ARR, struct.pack("<IQ", U8, 2**40))
    return body + b"\0" * (121 - len(body))


def test_a_huge_array_count_is_refused_before_any_loop_or_allocation(tmp_path):
    """gguf-py's reader loops over 2**40 zero-byte views (memory grows without end): the check
    against the file size must come first."""
    import gguf  # noqa: F401  (imported before memory is traced)

    path = tmp_path / "huge.gguf"
    path.write_bytes(hostile_121_bytes())
    assert path.stat().st_size == 121

    tracemalloc.start()
    try:
        with _deadline(20), pytest.raises(CheckpointError) as info:
            GGUFSource(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(info.value) == (
        f"{path}: not a readable GGUF file: metadata array 'tokenizer.ggml.tokens' of 1099511627776 "
        "items at byte 69 needs 1099511627776 bytes, the file has 52 left"
    )
    assert peak < 2**20  # nothing sized by the claimed count


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"GGUX" + b"\0" * 40, "starts with b'GGUX'"),
        (_head(0, 0, version=7), "version 7"),
        (_head(0, 2**62), "4611686018427387904 metadata entries"),
        (_head(2**61, 1) + ARCH, "2305843009213693952 tensors"),
        (_head(0, 1) + _kv(b"k", U32, b"\0\0"), "the value of 'k' at byte 37 needs 4 bytes"),  # cut short
        (
            _head(0, 1) + struct.pack("<Q", 2**63) + b"k" * 8,
            "a metadata key at byte 32 needs 9223372036854775808 bytes",
        ),
        (_head(0, 1) + _kv(b"k", STR, struct.pack("<Q", 2**40) + b"abc"), "the value of 'k' at byte"),
        (_head(0, 1) + _kv(b"k", 13, b"\0" * 8), "'k' has unknown value type 13"),
        (_head(0, 1) + _kv(b"k", ARR, struct.pack("<IQ", ARR, 1) + b"\0" * 12), "array of arrays"),
        (_head(0, 1) + _kv(b"k", ARR, struct.pack("<IQ", 99, 1) + b"\0" * 8), "unknown item type 99"),
        (_head(0, 1) + _kv(b"k", ARR, struct.pack("<IQ", STR, 2**59)), "'k' of 576460752303423488 items"),
        (_head(0, 2) + ARCH + ARCH, "'general.architecture' appears twice"),
        (_head(0, 1) + _kv(b"\xff\xfe", U8, b"\0"), "is not UTF-8"),
        (_file([], kvs=(ARCH, _kv(b"general.alignment", U32, struct.pack("<I", 3)))), "alignment 3"),
        (_file([_tensor(b"t", (4, 1, 1, 1, 1))]), "'t' has 5 dims"),
        (_file([_tensor(b"t", (4, 0))]), "'t' has dims [4, 0]"),
        (_file([_tensor(b"t", (4,), qtype=1000)]), "'t' has unknown type 1000"),
        (_file([_tensor(b"t", (33,), qtype=8)]), "the first a multiple of 32"),  # Q8_0 rows of 32
        (_file([_tensor(b"t", (2**31, 2**31))]), "'t' (F32 [2147483648, 2147483648]) needs bytes"),
        (_file([_tensor(b"t", (4,), offset=2**64 - 32)], b"\0" * 16), "'t' (F32 [4]) needs bytes"),
        (_file([_tensor(b"t", (4,), offset=3)], b"\0" * 32), "offset 3, not a multiple"),
        (_file([_tensor(b"t", (4,)), _tensor(b"t", (4,), offset=32)], b"\0" * 64), "'t' appears twice"),
    ],
)
def test_every_structural_lie_is_one_named_line(tmp_path, data, why):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(CheckpointError) as info:
        GGUFSource(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and why in msg and "\n" not in msg


def test_a_hand_built_file_reads_back(tmp_path):
    """The checks accept what they should: a valid file with one F32 tensor and a small array."""
    path = tmp_path / "ok.gguf"
    kvs = (ARCH, _kv(b"a", ARR, struct.pack("<IQ", U32, 3) + struct.pack("<3I", 7, 8, 9)))
    path.write_bytes(_file([_tensor(b"t", (2, 2))], struct.pack("<4f", 1, 2, 3, 4), kvs=kvs))
    src = GGUFSource(path)
    assert src.arch == "qwen3moe" and src.metadata["a"] == [7, 8, 9] and src.array_length("a") == 3
    assert src.float_tensor("t").tolist() == [[1, 2], [3, 4]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_gguf("qwen3_moe", tmp_path_factory.mktemp("gguf"), expert_type="Q8_0")


def test_truncated_while_it_converts_is_an_error_not_a_sigbus(tiny, tmp_path):
    """The file is cut after its metadata was read and before any tensor byte is: the engine used
    to map it (SIGBUS, no message, a partial .ftw.tmp left in the cache)."""
    path = tmp_path / "model.gguf"
    path.write_bytes(tiny.path.read_bytes())
    cache = tmp_path / "cache"
    script = textwrap.dedent(
        f"""
        import os
        from freetoken_agents.engine import Engine
        from freetoken_agents.engine.errors import EngineError
        import gguf
        from freetoken_agents.engine.loading.gguf import convert
        first = gguf.GGUFReader({str(path)!r}).data_offset  # where the tensor data starts
        original = convert.tokenizer_files
        def cut_after_metadata(src):
            files = original(src)
            os.truncate(src.path, first // 4096 * 4096)  # whole pages gone: mapped reads fault
            return files
        convert.tokenizer_files = cut_after_metadata
        try:
            Engine.from_pretrained({str(path)!r}, cache_dir={str(cache)!r})
        except EngineError as e:
            print(type(e).__name__ + ":", e)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"rc {run.returncode}: {run.stderr[-2000:]}"
    assert f"CheckpointError: {path}: truncated GGUF file: tensor '" in run.stdout
    left = sorted(p.name for p in (cache / "ftw").iterdir())
    assert [n for n in left if not n.endswith(".lock")] == []  # no .ftw, .ftw.tmp, stamp or record
    for lock in left:  # released: a lock left locked would block every later load
        with FileLock(str(cache / "ftw" / lock), timeout=0):
            pass


def test_a_dead_conversions_partial_file_is_swept_unless_in_use(tmp_path):
    """A conversion that was killed leaves ``<entry>.ftw.tmp``: the next load deletes it when no one
    holds its entry's lock, and leaves a file being written right now alone."""
    root = tmp_path / "cache" / "ftw"
    root.mkdir(parents=True)
    (root / "dead-1-source-source.ftw.tmp").write_bytes(b"\0" * 4096)
    (root / "busy-2-source-source.ftw.tmp").write_bytes(b"\0" * 4096)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + b"\0" * 60)  # this load fails too: the sweep comes first
    with FileLock(str(root / "busy-2-source-source.ftw.lock")):
        with pytest.raises(CheckpointError, match="bad.gguf"):
            cached_ftw(bad, quant="source", dense_dtype=None, cache_dir=tmp_path / "cache", progress=False)
    assert sorted(p.name for p in root.glob("*.tmp")) == ["busy-2-source-source.ftw.tmp"]


def test_seeded_fuzz_of_the_reader_finds_only_named_errors(tiny, tmp_path):
    """30 cases of `bench/fuzz_gguf.py`'s structural mutations (header, metadata arrays and strings,
    tensor directory, tensor data, truncation, bit flips), read in-process: each file parses and
    reads, or is one CheckpointError line naming it. (Seed 55 includes an int32 array claiming
    2**32 items, on which gguf-py's reader loops.)"""
    base = tiny.path.read_bytes()
    with _deadline(60):
        outcomes = fuzz_gguf.read_cases(base, tmp_path, seed=55, count=30, kinds=fuzz_gguf.READER_KINDS)
    raw = [o for o in outcomes if o.status not in ("ok", "named")]
    assert raw == []
    assert {o.kind for o in outcomes} == set(fuzz_gguf.READER_KINDS)
    named = [o for o in outcomes if o.status == "named"]
    assert len(named) >= 10 and all(o.error == "CheckpointError" and "\n" not in o.message for o in named)


@pytest.mark.parametrize(
    ("tensor", "dim", "factor"),
    [("blk.0.ffn_down_exps.weight", 1, 0.5), ("blk.0.ffn_gate_exps.weight", 0, 2)],  # rows; input width
)
def test_expert_shapes_that_disagree_with_the_metadata_fail_conversion(tiny, tmp_path, tensor, dim, factor):
    """A directory entry that changes one expert tensor's dims (still in bounds, so the layout is
    sound): the conversion must name it, not write a cache entry every later load rejects, nor
    fuse a gate and an up of different widths (a raw torch error)."""
    data = bytearray(tiny.path.read_bytes())
    index = list(GGUFSource(tiny.path).tensors).index(tensor)
    (fld,) = (f for f in fuzz_gguf.fields(bytes(data))[0] if f.label == f"dim {dim} of tensor {index}")
    size = struct.unpack_from("<Q", data, fld.offset)[0]
    struct.pack_into("<Q", data, fld.offset, int(size * factor))
    path = tmp_path / "changed.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"changed.gguf: the tensors of layer 0's expert 0 have shapes"):
        convert_gguf(path, tmp_path / "o.ftw", progress=False)
    assert not (tmp_path / "o.ftw").exists()
    with pytest.raises(CheckpointError, match="changed.gguf"):
        Engine.from_pretrained(path, cache_dir=tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache" / "ftw").iterdir() if not p.name.endswith(".lock")] == []
