"""Property-based fuzz tests of the FTW reader: damaged files fail loudly or read back exactly.

One small but realistic FTW file (dense tensors of several dtypes, 6 expert blocks in mixed codecs,
some zstd-compressed) is written once per module; every example mutates a copy of its bytes and
reads everything back: `FTWFile(path)`, `dense(name, verify=True)` for every dense tensor,
`decode_expert` for every block and `verify()`.

Property (`_read_everything`): each read either raises `FTWFormatError` whose message names the file
and a byte offset (and, for an expert, the block), or returns data bit-identical to the pristine
file's. Never another exception, never wrong numbers. For byte-level damage the test also knows
*which* reads must fail: the layout (`_Regions`) maps every byte of the file to what it belongs to
(the fixed header, a dense tensor, an expert block, the manifest, or padding nobody reads), so the
expected set of failures is exact: damage in padding is harmless, damage anywhere else is caught
by exactly the read that covers it, and the other reads still return the original data.

A second family ("resealed") models a buggy or hostile *writer*: the manifest or a block is edited
and every checksum recomputed, so nothing is corrupt in the checksum sense. There the data may
legitimately differ (the manifest is the ground truth), so the property is only: `FTWFormatError`
or success, never another exception, and decoded tensors have the shapes the manifest declares.

Hypothesis runs derandomized with no example database, so CI is deterministic.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import build_tiny_model

from freetoken_agents.engine import Engine
from freetoken_agents.engine.errors import FTWFormatError
from freetoken_agents.engine.ftw import EncodedTensor, FTWFile, FTWWriter, decode, encode
from freetoken_agents.engine.ftw.layout import (
    ALIGNMENT,
    BLOCK_HEADER_SIZE,
    BLOCK_STRUCT,
    FORMAT_MAJOR,
    HEADER_HASH_STRUCT,
    HEADER_SIZE,
    HEADER_STRUCT,
    MAGIC,
    hex64,
)
from freetoken_agents.engine.loading.convert import convert_checkpoint

CONFIG: dict[str, Any] = {"model_type": "fuzz_moe", "hidden_size": 32, "num_experts": 4}
TOKENIZER = {"tokenizer.json": b'{"version": "1.0", "model": {}}'}
METADATA = {"source": "test_ftw_fuzz"}

# (layer, expert) -> ({projection: codec}, zstd?); gate_up [192, 64] spans two fp8 scale rows.
PLAN: dict[tuple[int, int], tuple[dict[str, str], bool]] = {
    (0, 0): ({"gate_up": "mxfp4", "down": "int8", "gate_up_bias": "fp32"}, False),
    (0, 1): ({"gate_up": "bf16", "down": "bf16", "gate_up_bias": "bf16"}, True),
    (0, 2): ({"gate_up": "fp8_e4m3", "down": "mxfp4"}, True),
    (1, 0): ({"gate_up": "fp32", "down": "fp8_e4m3"}, False),
    (1, 1): ({"gate_up": "int8", "down": "fp32", "gate_up_bias": "bf16"}, True),
    (1, 3): ({"gate_up": "mxfp4", "down": "mxfp4"}, False),
}
SHAPES = {"gate_up": (192, 32), "down": (32, 96), "gate_up_bias": (192,)}  # H = 32, I = 96

Item = tuple[str, Any]
"""What a byte belongs to: ("open", None), ("dense", name) or ("expert", (layer, expert))."""
OPEN: Item = ("open", None)

# Deterministic in CI: derandomized, no example database. Each property sets its own max_examples,
# sized so the whole module runs in about 20 s on 2 shared cores.
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


FUZZ_SCALE = int(os.environ.get("FTW_FUZZ_SCALE", "1"))
"""Multiplier of every property's max_examples, for a deep run: ``FTW_FUZZ_SCALE=50 pytest ...``."""


def fuzz(max_examples: int) -> settings:
    """`FUZZ` with ``max_examples * FUZZ_SCALE`` examples."""
    return settings(FUZZ, max_examples=max_examples * FUZZ_SCALE)


# ---- the pristine file -----------------------------------------------------------------------------


def _dense_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(40, 64, generator=g),
        "norm.weight": (1 + 0.1 * torch.randn(64, generator=g)).bfloat16(),
        "half": torch.randn(3, 5, generator=g).half(),
        "fp8": torch.randn(7, 9, generator=g).to(torch.float8_e4m3fn),
        "fp8_scale_inv": torch.rand(1, 1, generator=g) + 0.5,
        "u8": torch.randint(0, 256, (33,), dtype=torch.uint8, generator=g),
        "i8": torch.randint(-128, 128, (4, 4), dtype=torch.int8, generator=g),
        "i64": torch.tensor([-(2**62), 0, 2**62 + 5]),
        "mask": torch.tensor([[True, False, True]]),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
    }


def _expert(layer: int, expert: int) -> dict[str, EncodedTensor]:
    g = torch.Generator().manual_seed(100 * layer + expert)
    codecs, _ = PLAN[(layer, expert)]
    return {p: encode(torch.randn(*SHAPES[p], generator=g) * 0.05, c) for p, c in codecs.items()}


def _raw(t: torch.Tensor) -> bytes:
    """The bytes of a tensor (so -0.0 != 0.0 and NaN == NaN: bit identity)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@dataclass(frozen=True)
class _Regions:
    """Map from byte offset to the `Item` whose read covers it (None: padding no read touches)."""

    spans: tuple[tuple[int, int, Item], ...]  # sorted, disjoint [start, end)

    def item_at(self, offset: int) -> Item | None:
        for start, end, item in self.spans:
            if start <= offset < end:
                return item
        return None

    def of(self, kind: str) -> list[tuple[int, int]]:
        return [(s, e) for s, e, item in self.spans if item[0] == kind]


@dataclass(frozen=True)
class Reference:
    """The pristine file, what every read of it returns, and its byte map."""

    data: bytes
    dense: dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]
    experts: dict[tuple[int, int], dict[str, tuple[tuple[int, ...], bytes]]]
    dense_offsets: dict[str, int]
    expert_offsets: dict[tuple[int, int], int]
    compressed: tuple[tuple[int, int], ...]
    regions: _Regions
    manifest: dict[str, Any]
    dir: Path

    @property
    def padding(self) -> list[tuple[int, int]]:
        """Spans of bytes that belong to nothing (alignment padding)."""
        out, pos = [], 0
        for s, e, _ in self.regions.spans:
            if s > pos:
                out.append((pos, s))
            pos = e
        return out


def _write_pristine(path: Path) -> None:
    dense = _dense_tensors()
    names = list(dense)
    with FTWWriter(path, model_config=CONFIG, tokenizer_files=TOKENIZER, metadata=METADATA) as w:
        for name in names[:6]:
            w.add_dense(name, dense[name])
        for key, (_, compress) in PLAN.items():
            w.add_expert(*key, _expert(*key), compress=compress)
            if key == (0, 1):  # dense tensors between expert blocks, as a streaming writer may put them
                for name in names[6:]:
                    w.add_dense(name, dense[name])


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    root = tmp_path_factory.mktemp("ftw_fuzz")
    path = root / "pristine.ftw"
    _write_pristine(path)
    data = path.read_bytes()
    m_off, m_len = HEADER_STRUCT.unpack_from(data)[5:7]
    spans: list[tuple[int, int, Item]] = [(0, HEADER_SIZE, OPEN), (m_off, m_off + m_len, OPEN)]
    with FTWFile(path) as f:
        dense = {}
        for name in f.dense_names():
            t = f.dense(name, verify=True)
            dense[name] = (t.dtype, tuple(t.shape), _raw(t))
            d = f.dense_info(name)
            if d.nbytes:
                spans.append((d.offset, d.offset + d.nbytes, ("dense", name)))
        experts = {}
        for key in f.expert_keys():
            x = f.expert_info(*key)
            experts[key] = {p: (tuple(t.shape), _raw(t)) for p, t in f.decode_expert(*key).items()}
            # The reader reads the whole 64-byte block header but only the BLOCK_STRUCT part matters.
            spans.append((x.offset, x.offset + BLOCK_STRUCT.size, ("expert", key)))
            spans.append((x.data_offset, x.data_offset + x.stored_length, ("expert", key)))
        dense_offsets = {n: f.dense_info(n).offset for n in f.dense_names()}
        expert_offsets = {k: f.expert_info(*k).offset for k in f.expert_keys()}
        compressed = tuple(k for k in f.expert_keys() if f.expert_info(*k).compression == "zstd")
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), "overlapping regions"
    # The pristine file really has every dense dtype and codec in it, and both compressions.
    assert {dt for dt, _, _ in dense.values()} >= {torch.float32, torch.bfloat16, torch.float8_e4m3fn}
    assert {c for codecs, _ in PLAN.values() for c in codecs.values()} == {
        "fp32",
        "bf16",
        "fp8_e4m3",
        "int8",
        "mxfp4",
    }
    assert 0 < len(compressed) < len(experts)
    return Reference(
        data=data,
        dense=dense,
        experts=experts,
        dense_offsets=dense_offsets,
        expert_offsets=expert_offsets,
        compressed=compressed,
        regions=_Regions(tuple(spans)),
        manifest=json.loads(data[m_off : m_off + m_len]),
        dir=root,
    )


# ---- reading everything ----------------------------------------------------------------------------


def _write(ref: Reference, data: bytes | bytearray, name: str = "mutant.ftw") -> Path:
    """Put `data` at a fresh inode (a dense view of a previous mutant may still map the old one)."""
    path = ref.dir / name
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)
    return path


def _check_message(e: FTWFormatError, path: Path, *needles: str) -> None:
    msg = str(e)
    assert str(path) in msg, msg
    assert "byte offset" in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def _read_everything(path: Path, ref: Reference) -> set[Item]:
    """Open `path` and read every dense tensor (verified) and every expert; return what failed.

    Asserts the property of the module docstring: failures are FTWFormatErrors naming the file,
    the offset and the item; everything that does not fail is bit-identical to the pristine file.
    """
    try:
        f = FTWFile(path)
    except FTWFormatError as e:
        _check_message(e, path)
        return {OPEN}
    failed: set[Item] = set()
    with f:
        # The manifest is checksummed: if the file opened, it is the pristine manifest.
        assert f.model_config == CONFIG and f.metadata == METADATA and f.tokenizer_files == TOKENIZER
        assert f.dense_names() == list(ref.dense) and f.expert_keys() == list(ref.experts)
        for name, (dtype, shape, raw) in ref.dense.items():
            try:
                t = f.dense(name, verify=True)
            except FTWFormatError as e:
                _check_message(e, path, repr(name), f"byte offset {ref.dense_offsets[name]}")
                failed.add(("dense", name))
                continue
            assert t.dtype == dtype and tuple(t.shape) == shape and _raw(t) == raw, name
        for key, projections in ref.experts.items():
            try:
                got = f.decode_expert(*key)
            except FTWFormatError as e:
                _check_message(e, path, f"expert block (layer={key[0]}, expert={key[1]})")
                failed.add(("expert", key))
                continue
            assert set(got) == set(projections), key
            for p, (shape, raw) in projections.items():
                assert tuple(got[p].shape) == shape and _raw(got[p]) == raw, (key, p)
        try:
            f.verify()
        except FTWFormatError as e:
            _check_message(e, path)
            assert failed, f"verify() failed on a file whose reads all succeeded: {e}"
        else:
            assert not failed, f"verify() passed although {failed} failed"
    return failed


def _reseal_header(data: bytearray) -> None:
    """Recompute the fixed header's checksum after editing its fields."""
    struct.pack_into(
        HEADER_HASH_STRUCT.format,
        data,
        HEADER_STRUCT.size,
        xxhash.xxh64_intdigest(data[: HEADER_STRUCT.size]),
    )


def _with_manifest(data: bytes, blob: bytes) -> bytearray:
    """`data` with its manifest replaced by `blob` (same offset), header fields and checksums consistent."""
    fields = list(HEADER_STRUCT.unpack_from(data))
    m_off = fields[5]
    fields[6], fields[7] = len(blob), xxhash.xxh64_intdigest(blob)
    out = bytearray(data[:m_off] + blob)
    HEADER_STRUCT.pack_into(out, 0, *fields)
    _reseal_header(out)
    return out


def _dump(manifest: Any) -> bytes:
    return json.dumps(manifest, separators=(",", ":")).encode()


def test_pristine_file_reads_back_exactly(ref: Reference) -> None:
    assert _read_everything(_write(ref, ref.data), ref) == set()
    assert _with_manifest(ref.data, _dump(ref.manifest)) == bytearray(ref.data)  # helper is faithful
    # Every codec decodes as it did before writing.
    for key in PLAN:
        for p, enc in _expert(*key).items():
            assert _raw(decode(enc)) == ref.experts[key][p][1], (key, p)


# ---- byte-level damage: exact expectations --------------------------------------------------------


def _offsets(ref: Reference) -> st.SearchStrategy[int]:
    """Offsets anywhere in the file, biased towards each kind of region (most bytes are padding)."""
    size = len(ref.data)

    def inside(spans: list[tuple[int, int]]) -> st.SearchStrategy[int]:
        return st.sampled_from(spans).flatmap(lambda se: st.integers(se[0], se[1] - 1))

    header_fields = st.integers(0, HEADER_SIZE - 1)
    block_headers = st.sampled_from(sorted(ref.expert_offsets.values())).flatmap(
        lambda off: st.integers(off, off + BLOCK_HEADER_SIZE - 1)  # fields and their zero padding
    )
    zstd_frame_heads = st.sampled_from(ref.compressed).flatmap(
        lambda k: st.integers(0, 15).map(lambda i: ref.expert_offsets[k] + BLOCK_HEADER_SIZE + i)
    )
    return st.one_of(
        st.integers(0, size - 1),
        header_fields,
        st.integers(HEADER_SIZE, ALIGNMENT - 1),  # header padding
        inside(ref.regions.of("dense")),
        block_headers,
        zstd_frame_heads,
        inside(ref.regions.of("expert")),
        inside(ref.regions.of("open")[1:]),  # the manifest
        inside(ref.padding),
    )


@fuzz(150)
@given(data=st.data())
def test_flipped_bytes_fail_exactly_where_they_are(ref: Reference, data: st.DataObject) -> None:
    flips = data.draw(
        st.lists(
            st.tuples(_offsets(ref), st.integers(1, 255)), min_size=1, max_size=4, unique_by=lambda t: t[0]
        ),
        label="flips (offset, xor mask)",
    )
    buf = bytearray(ref.data)
    for offset, mask in flips:
        buf[offset] ^= mask
    hit = {ref.regions.item_at(offset) for offset, _ in flips} - {None}
    expected = {OPEN} if OPEN in hit else hit
    assert _read_everything(_write(ref, buf), ref) == expected


@fuzz(25)
@given(data=st.data())
def test_truncated_files_fail_at_open(ref: Reference, data: st.DataObject) -> None:
    size = len(ref.data)
    keep = data.draw(
        st.one_of(st.integers(0, size - 1), st.integers(max(0, size - 600), size - 1), st.integers(0, 64)),
        label="bytes kept",
    )
    path = _write(ref, ref.data[:keep])
    with pytest.raises(FTWFormatError, match="truncated") as ei:
        FTWFile(path)
    _check_message(ei.value, path)
    assert _read_everything(path, ref) == {OPEN}


@fuzz(15)
@given(magic=st.binary(min_size=4, max_size=4).filter(lambda m: m != MAGIC))
def test_wrong_magic_fails_at_open(ref: Reference, magic: bytes) -> None:
    path = _write(ref, magic + ref.data[4:])
    with pytest.raises(FTWFormatError, match="not an FTW file") as ei:
        FTWFile(path)
    _check_message(ei.value, path, "byte offset 0")


@fuzz(15)
@given(
    major=st.integers(0, 2**16 - 1).filter(lambda m: m != FORMAT_MAJOR),
    minor=st.integers(0, 2**16 - 1),
)
def test_other_major_versions_fail_at_open(ref: Reference, major: int, minor: int) -> None:
    buf = bytearray(ref.data)
    struct.pack_into("<HH", buf, 4, major, minor)
    _reseal_header(buf)  # a consistent header: it is the version check that must fire
    path = _write(ref, buf)
    with pytest.raises(FTWFormatError, match=f"unsupported FTW format version {major}.{minor}") as ei:
        FTWFile(path)
    _check_message(ei.value, path, "byte offset 4")


@fuzz(15)
@given(garbage=st.binary(min_size=1, max_size=9000))
def test_appended_garbage_is_ignored(ref: Reference, garbage: bytes) -> None:
    # The manifest is found through the header, so trailing bytes are never read.
    assert _read_everything(_write(ref, ref.data + garbage), ref) == set()


# ---- resealed edits (a buggy or hostile writer): FTWFormatError or success, nothing else ----------


def _leaves(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths of every node below the root (containers included) of a JSON value."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield (*path, k)
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield (*path, i)
            yield from _leaves(v, (*path, i))


_JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 63, 64, 4095, 4096, 4097, 2**31, 2**32, 2**32 - 1, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(
        ["zstd", "none", "fp32", "bf16", "fp8_e4m3", "int8", "mxfp4", "float32", "uint8", "bool"]
    ),
)
_JSON = st.recursive(
    _JSON_SCALARS,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=4), kids, max_size=3)
    ),
    max_leaves=6,
)


def _edit(manifest: Any, path: tuple[Any, ...], value: Any, delete: bool) -> Any:
    """A deep copy of `manifest` with the node at `path` replaced by `value` (or removed)."""
    out = json.loads(json.dumps(manifest))
    parent = out
    for k in path[:-1]:
        parent = parent[k]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return out


def _read_anything(path: Path) -> None:
    """Read everything a resealed file claims to hold; only FTWFormatError may escape."""
    try:
        f = FTWFile(path)
    except FTWFormatError as e:
        assert str(path) in str(e)
        return
    with f:
        for name in f.dense_names():
            try:
                t = f.dense(name, verify=True)
            except FTWFormatError as e:
                assert str(path) in str(e)
                continue
            assert tuple(t.shape) == f.dense_info(name).shape
        for key in f.expert_keys():
            try:
                got = f.decode_expert(*key)
            except FTWFormatError as e:
                assert str(path) in str(e) and f"layer={key[0]}, expert={key[1]}" in str(e)
                continue
            info = f.expert_info(*key)
            assert {p: tuple(t.shape) for p, t in got.items()} == {
                p: t.shape for p, t in info.tensors.items()
            }
        try:
            f.verify()
        except FTWFormatError as e:
            assert str(path) in str(e)
        try:  # base64 of the embedded files, decoded on access
            _ = f.tokenizer_files
        except FTWFormatError as e:
            assert str(path) in str(e)


@fuzz(80)
@given(data=st.data())
def test_resealed_manifest_edits_never_crash(ref: Reference, data: st.DataObject) -> None:
    paths = [p for p in _leaves(ref.manifest) if p[0] in ("format", "dense", "experts", "tokenizer_files")]
    edits = data.draw(
        st.lists(st.tuples(st.sampled_from(paths), _JSON, st.booleans()), min_size=1, max_size=3),
        label="edits (path, value, delete?)",
    )
    manifest: Any = ref.manifest
    for path, value, delete in edits:
        try:
            manifest = _edit(manifest, path, value, delete)
        except (KeyError, IndexError, TypeError):  # an earlier edit removed or replaced the parent
            continue
    _read_anything(_write(ref, _with_manifest(ref.data, _dump(manifest))))


def _reseal_block(data: bytes, manifest: dict[str, Any], key: tuple[int, int], stored: bytes) -> bytearray:
    """`data` with block `key`'s stored bytes replaced by `stored` (same length), checksums resealed."""
    manifest = json.loads(json.dumps(manifest))
    rec = next(r for r in manifest["experts"] if (r["layer"], r["expert"]) == key)
    assert len(stored) == rec["stored_length"]
    buf = bytearray(data)
    start = rec["offset"] + BLOCK_HEADER_SIZE
    buf[start : start + len(stored)] = stored
    digest = xxhash.xxh64_intdigest(stored)
    fields = list(BLOCK_STRUCT.unpack_from(buf, rec["offset"]))
    fields[5] = digest
    BLOCK_STRUCT.pack_into(buf, rec["offset"], *fields)
    rec["xxhash64"] = hex64(digest)
    return _with_manifest(bytes(buf), _dump(manifest))


@fuzz(50)
@given(data=st.data())
def test_resealed_block_edits_never_crash(ref: Reference, data: st.DataObject) -> None:
    key = data.draw(st.sampled_from(list(ref.experts)), label="block")
    rec = next(r for r in ref.manifest["experts"] if (r["layer"], r["expert"]) == key)
    start = rec["offset"] + BLOCK_HEADER_SIZE
    stored = bytearray(ref.data[start : start + rec["stored_length"]])
    n = len(stored)
    offsets = st.one_of(st.integers(0, min(n, 24) - 1), st.integers(0, n - 1))  # frame header or anywhere
    for off, mask in data.draw(st.lists(st.tuples(offsets, st.integers(1, 255)), min_size=1, max_size=4)):
        stored[off] ^= mask
    _read_anything(_write(ref, _reseal_block(ref.data, ref.manifest, key, bytes(stored))))


# ---- explicit cases -------------------------------------------------------------------------------


def test_future_major_version(ref: Reference) -> None:
    buf = bytearray(ref.data)
    struct.pack_into("<H", buf, 4, FORMAT_MAJOR + 1)
    _reseal_header(buf)
    path = _write(ref, buf, "future.ftw")
    with pytest.raises(FTWFormatError) as ei:
        FTWFile(path)
    _check_message(ei.value, path, f"unsupported FTW format version {FORMAT_MAJOR + 1}.0", "byte offset 4")
    # A newer MINOR version of the same major is readable (the manifest records it too).
    manifest = json.loads(json.dumps(ref.manifest))
    manifest["format"]["minor"] = 7
    buf = _with_manifest(ref.data, _dump(manifest))
    struct.pack_into("<H", buf, 6, 7)
    _reseal_header(buf)
    with FTWFile(_write(ref, buf, "minor.ftw")) as f:
        assert f.version == (FORMAT_MAJOR, 7)


def test_flipped_dense_byte_is_caught_by_verify(ref: Reference) -> None:
    for name, (_, _, raw) in ref.dense.items():
        if not raw:
            continue
        off = ref.dense_offsets[name] + len(raw) // 2
        buf = bytearray(ref.data)
        buf[off] ^= 0x10
        path = _write(ref, buf, "dense.ftw")
        with FTWFile(path) as f:
            assert _raw(f.dense(name)) != raw  # an unverified view is zero-cost and does not check
            with pytest.raises(FTWFormatError) as ei:
                f.dense(name, verify=True)
            _check_message(ei.value, path, repr(name), "checksum", f"byte offset {ref.dense_offsets[name]}")
        assert _read_everything(path, ref) == {("dense", name)}


def test_expert_index_out_of_range_in_the_manifest(ref: Reference, tmp_path: Path) -> None:
    """A consistent manifest naming an expert the model does not have is refused by name and offset."""
    src = tmp_path / "mixtral.ftw"
    folder = build_tiny_model("mixtral", tmp_path / "hf", with_tokenizer=False)  # 3 layers x 8 experts
    convert_checkpoint(folder, src, quant="int8", progress=False)
    data = src.read_bytes()
    m_off, m_len = HEADER_STRUCT.unpack_from(data)[5:7]
    manifest = json.loads(data[m_off : m_off + m_len])
    rec = next(r for r in manifest["experts"] if (r["layer"], r["expert"]) == (1, 7))
    rec["expert"] = 8  # mixtral tiny model: 8 experts per layer, ids 0..7
    bad = tmp_path / "out_of_range.ftw"
    bad.write_bytes(_with_manifest(data, _dump(manifest)))
    with pytest.raises(FTWFormatError) as ei:
        Engine.from_pretrained(bad)
    _check_message(
        ei.value, bad, "expert block (layer=1, expert=8)", f"byte offset {rec['offset']}", "out of range"
    )
    # The container itself opens (the manifest is well formed), but the block's own header, which
    # says expert 7, disagrees with the manifest when it is read.
    with FTWFile(bad) as f:
        assert (1, 8) in f.expert_keys() and (1, 7) not in f.expert_keys()
        with pytest.raises(FTWFormatError) as ei:
            f.decode_expert(1, 8)
        _check_message(ei.value, bad, "(layer=1, expert=8)", "disagrees with the manifest")
    # Ids that no block header can hold (u32) or that are negative are refused at open.
    for value in (-1, 2**32, 2**64):
        rec["expert"] = value
        p = _write(ref, _with_manifest(data, _dump(manifest)), "range.ftw")
        with pytest.raises(FTWFormatError, match="malformed manifest") as ei:
            FTWFile(p)
        _check_message(ei.value, p)


# ---- regressions: resealed files that made the reader raise something other than FTWFormatError ----


def _regression(ref: Reference, edit: Callable[[dict[str, Any]], None]) -> Path:
    manifest = json.loads(json.dumps(ref.manifest))
    edit(manifest)
    return _write(ref, _with_manifest(ref.data, _dump(manifest)), "regression.ftw")


def test_regression_deeply_nested_manifest(ref: Reference) -> None:
    """json.loads raised RecursionError on a (consistently checksummed) deeply nested manifest."""
    path = _write(ref, _with_manifest(ref.data, b"[" * 100_000 + b"]" * 100_000), "nested.ftw")
    with pytest.raises(FTWFormatError, match="malformed manifest") as ei:
        FTWFile(path)
    _check_message(ei.value, path)


@pytest.mark.parametrize("shape", [[2**63, 0], [2**64, 0], [2**40, 2**40, 0]])
def test_regression_shapes_torch_cannot_hold(ref: Reference, shape: list[int]) -> None:
    """A zero-sized dense tensor or part with dims past int64 made torch raise TypeError/RuntimeError."""

    def dense(m: dict[str, Any]) -> None:
        m["dense"]["empty"]["shape"] = shape

    path = _regression(ref, dense)
    with pytest.raises(FTWFormatError, match="malformed manifest") as ei:
        FTWFile(path)
    _check_message(ei.value, path)

    def part(m: dict[str, Any]) -> None:
        m["experts"][0]["tensors"]["gate_up"]["shape"] = shape

    _read_anything(_regression(ref, part))


@pytest.mark.parametrize("content_size", [2**36, 2**62])
def test_regression_zstd_frame_declaring_a_huge_content_size(ref: Reference, content_size: int) -> None:
    """A zstd frame header claiming a huge content size made zstandard raise MemoryError."""
    key = ref.compressed[0]
    rec = next(r for r in ref.manifest["experts"] if (r["layer"], r["expert"]) == key)
    start = rec["offset"] + BLOCK_HEADER_SIZE
    stored = ref.data[start : start + rec["stored_length"]]
    params = zstandard.get_frame_parameters(stored)
    assert params.content_size == rec["raw_length"] and stored[4] & 0xC0 == 0x40  # 2-byte FCS field
    # Same frame, frame content size field widened to 8 bytes holding `content_size`; the block is
    # then 6 bytes longer, so drop 6 bytes at its end (the frame is invalid anyway past the header).
    forged = stored[:4] + bytes([stored[4] | 0xC0]) + struct.pack("<Q", content_size) + stored[7:-6]
    assert zstandard.frame_content_size(forged) == content_size
    path = _write(ref, _reseal_block(ref.data, ref.manifest, key, forged), "zstd.ftw")
    with FTWFile(path) as f:
        with pytest.raises(FTWFormatError) as ei:
            f.decode_expert(*key)
        _check_message(ei.value, path, f"(layer={key[0]}, expert={key[1]})", str(content_size))
    # Also when the manifest agrees with the frame: the allocation fails, and that is reported as a
    # bad block, not a MemoryError.
    sealed = _reseal_block(ref.data, ref.manifest, key, forged)
    m_off, m_len = HEADER_STRUCT.unpack_from(sealed)[5:7]
    manifest = json.loads(bytes(sealed[m_off : m_off + m_len]))
    next(r for r in manifest["experts"] if (r["layer"], r["expert"]) == key)["raw_length"] = content_size
    path = _write(ref, _with_manifest(bytes(sealed), _dump(manifest)), "zstd2.ftw")
    with FTWFile(path) as f:
        with pytest.raises(FTWFormatError) as ei:
            f.decode_expert(*key)
        _check_message(ei.value, path, f"(layer={key[0]}, expert={key[1]})")


def test_corrupt_copy_leaves_the_pristine_file_alone(ref: Reference) -> None:
    """Sanity: the fuzz mutants are copies; the module's pristine bytes never change."""
    path = ref.dir / "pristine.ftw"
    assert path.read_bytes() == ref.data
    shutil.copy(path, ref.dir / "copy.ftw")
    assert _read_everything(ref.dir / "copy.ftw", ref) == set()
