"""Tests of the FTW container: layout, bit-exact round trips, corruption detection, atomic writes."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import torch
import xxhash

from freetoken_agents.engine.errors import FTWFormatError
from freetoken_agents.engine.ftw import (
    EncodedTensor,
    FTWFile,
    FTWWriter,
    decode,
    encode,
    wrap_mxfp4,
)
from freetoken_agents.engine.ftw.layout import BLOCK_HEADER_SIZE, HEADER_STRUCT

CONFIG = {"model_type": "tiny_moe", "hidden_size": 64, "num_experts": 3, "nested": {"a": [1, 2.5, None]}}
TOKENIZER = {"tokenizer.json": b'{"version": "1.0"}', "merges.bin": bytes(range(256))}

# (layer, expert) -> (codec per projection, compress?)
PLAN = {
    (0, 0): ({"gate": "mxfp4", "up": "fp8_e4m3", "down": "int8", "bias": "fp32"}, False),
    (0, 1): ({"gate": "bf16", "up": "bf16", "down": "bf16", "bias": "bf16"}, True),
    (0, 2): ({"gate": "fp32", "up": "int8", "down": "mxfp4", "bias": "fp32"}, True),
    (1, 0): ({"gate": "fp8_e4m3", "up": "mxfp4", "down": "fp8_e4m3", "bias": "fp32"}, False),
    (1, 1): ({"gate": "mxfp4", "up": "mxfp4", "down": "mxfp4", "bias": "bf16"}, True),
    (1, 2): ({"gate": "int8", "up": "fp32", "down": "bf16", "bias": "fp32"}, False),
}


def _dense_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(50, 64, generator=g),
        "norm.weight": torch.randn(64, generator=g).bfloat16(),
        "half": torch.randn(3, 5, generator=g).half(),
        "fp8": torch.randn(7, 9, generator=g).to(torch.float8_e4m3fn),
        "u8": torch.randint(0, 256, (33,), dtype=torch.uint8, generator=g),
        "i8": torch.randint(-128, 128, (4, 4), dtype=torch.int8, generator=g),
        "i32": torch.randint(-(2**31), 2**31 - 1, (11,), dtype=torch.int32, generator=g),
        "i64": torch.tensor([-(2**62), 0, 2**62 + 5]),
        "mask": torch.tensor([[True, False, True]]),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
    }


def _expert_encoded(layer: int, expert: int) -> dict[str, EncodedTensor]:
    g = torch.Generator().manual_seed(100 * layer + expert)
    codecs, _ = PLAN[(layer, expert)]
    shapes = {"gate": (96, 64), "up": (96, 64), "down": (64, 96), "bias": (96,)}
    return {p: encode(torch.randn(*shapes[p], generator=g) * 0.05, c) for p, c in codecs.items()}


def _raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture()
def ftw_path(tmp_path: Path) -> Path:
    path = tmp_path / "model.ftw"
    dense = _dense_tensors()
    with FTWWriter(path, model_config=CONFIG, tokenizer_files=TOKENIZER, metadata={"source": "test"}) as w:
        names = list(dense)
        for name in names[:5]:
            w.add_dense(name, dense[name])
        for key, (_, compress) in PLAN.items():
            w.add_expert(*key, _expert_encoded(*key), compress=compress)
            if key == (0, 1):  # interleave dense and expert writes
                for name in names[5:]:
                    w.add_dense(name, dense[name])
    return path


def test_metadata_round_trip(ftw_path: Path) -> None:
    with FTWFile(ftw_path) as f:
        assert f.version == (1, 0)
        assert f.model_config == CONFIG
        assert f.tokenizer_files == TOKENIZER
        assert f.metadata == {"source": "test"}
        assert f.expert_keys() == sorted(PLAN)
        assert set(f.dense_names()) == set(_dense_tensors())


def test_dense_bit_exact_and_owned(ftw_path: Path) -> None:
    dense = _dense_tensors()
    with FTWFile(ftw_path) as f:
        for name, t in dense.items():
            got = f.dense(name, verify=True)
            assert got.dtype == t.dtype and got.shape == t.shape, name
            assert _raw_bytes(got) == _raw_bytes(t), name
            assert f.dense_info(name).offset % 64 == 0
        a, b = f.dense("embed.weight"), f.dense("embed.weight")
        assert a.data_ptr() != b.data_ptr()  # each read owns its memory (issue 23: no file mapping)
        a[0, 0] = 1234.0  # never reaches the file or the other copy
        assert torch.equal(b, dense["embed.weight"])
    with FTWFile(ftw_path) as f:
        assert torch.equal(f.dense("embed.weight"), dense["embed.weight"])
    # Dense tensors outlive the file object.
    f = FTWFile(ftw_path)
    t = f.dense("embed.weight")
    f.close()
    del f
    assert torch.equal(t, dense["embed.weight"])


def test_experts_bit_exact_and_decode(ftw_path: Path) -> None:
    with FTWFile(ftw_path) as f:
        size = os.path.getsize(ftw_path)
        for key, (codecs, compress) in PLAN.items():
            info = f.expert_info(*key)
            assert info.offset % 4096 == 0
            assert info.compression == ("zstd" if compress else "none")
            assert info.data_offset + info.stored_length < size
            want = _expert_encoded(*key)
            got = f.encoded_expert(*key)
            assert set(got) == set(want)
            for p, enc in want.items():
                assert got[p].codec == enc.codec == codecs[p] and got[p].shape == enc.shape
                assert set(got[p].parts) == set(enc.parts)
                for part_name, part in enc.parts.items():
                    gp = got[p].parts[part_name]
                    assert gp.dtype == part.dtype and gp.shape == part.shape
                    assert _raw_bytes(gp) == _raw_bytes(part), (key, p, part_name)
            for dt in (torch.float32, torch.bfloat16):
                dec = f.decode_expert(*key, dtype=dt)
                for p, enc in want.items():
                    assert dec[p].dtype == dt
                    assert torch.equal(dec[p], decode(enc, dt)), (key, p)
        f.verify(progress=True)


def test_file_layout(ftw_path: Path) -> None:
    data = ftw_path.read_bytes()
    magic, major, minor, flags, align, m_off, m_len, m_hash = HEADER_STRUCT.unpack_from(data)
    assert (magic, major, minor, flags, align) == (b"FTW1", 1, 0, 0, 4096)
    assert m_off + m_len == len(data)  # manifest is the last thing in the file
    assert xxhash.xxh64_intdigest(data[m_off:]) == m_hash
    (h_hash,) = struct.unpack_from("<Q", data, HEADER_STRUCT.size)
    assert xxhash.xxh64_intdigest(data[: HEADER_STRUCT.size]) == h_hash
    with FTWFile(ftw_path) as f:
        for key in f.expert_keys():
            info = f.expert_info(*key)
            assert data[info.offset : info.offset + 4] == b"FTWX"
            layer, expert = struct.unpack_from("<II", data, info.offset + 4)
            assert (layer, expert) == key


def test_bytes_read_counts_only_read_blocks(ftw_path: Path) -> None:
    with FTWFile(ftw_path) as f:
        assert f.bytes_read == 0
        f.dense("embed.weight")
        assert f.bytes_read == 0
        f.decode_expert(1, 1)
        one = f.expert_info(1, 1)
        assert f.bytes_read == BLOCK_HEADER_SIZE + one.stored_length == one.block_length
        stored = f.read_expert_bytes(0, 2)
        assert f.bytes_read == one.block_length + f.expert_info(0, 2).block_length
        before = f.bytes_read
        out = f.decode_stored(0, 2, stored, torch.float32)  # decoding kept bytes reads nothing
        assert f.bytes_read == before
        assert set(out) == {"gate", "up", "down", "bias"}


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("key", [(0, 1), (1, 0)])  # a zstd block and a plain one
def test_corrupt_block_is_detected_and_others_still_read(ftw_path: Path, key: tuple[int, int]) -> None:
    with FTWFile(ftw_path) as f:
        info = f.expert_info(*key)
    _flip(ftw_path, info.data_offset + info.stored_length // 2)
    with FTWFile(ftw_path) as f:
        for call in (f.read_expert_bytes, f.decode_expert, f.encoded_expert):
            with pytest.raises(FTWFormatError) as ei:
                call(*key)
            msg = str(ei.value)
            assert str(ftw_path) in msg
            assert f"layer={key[0]}, expert={key[1]}" in msg
            assert f"byte offset {info.data_offset}" in msg
            assert "checksum" in msg
        for other in f.expert_keys():
            if other != key:
                f.decode_expert(*other)
        with pytest.raises(FTWFormatError, match=f"layer={key[0]}, expert={key[1]}"):
            f.verify()


def test_corrupt_block_header_is_detected(ftw_path: Path) -> None:
    with FTWFile(ftw_path) as f:
        info = f.expert_info(1, 2)
    _flip(ftw_path, info.offset + 4)  # the layer field
    with FTWFile(ftw_path) as f:
        with pytest.raises(FTWFormatError, match="disagrees with the manifest") as ei:
            f.read_expert_bytes(1, 2)
        assert f"byte offset {info.offset}" in str(ei.value)
    _flip(ftw_path, info.offset)  # the magic
    with FTWFile(ftw_path) as f, pytest.raises(FTWFormatError, match="block magic"):
        f.decode_expert(1, 2)


def test_decode_stored_checks_given_bytes(ftw_path: Path) -> None:
    with FTWFile(ftw_path) as f:
        stored = bytearray(f.read_expert_bytes(0, 0))
        stored[100] ^= 1
        with pytest.raises(FTWFormatError, match="checksum"):
            f.decode_stored(0, 0, bytes(stored), torch.float32)
        with pytest.raises(FTWFormatError, match="length"):
            f.decode_stored(0, 0, bytes(stored[:-1]), torch.float32, verify=False)


NEEDS_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_raw_where_the_bytes_are_equals_the_host_decode(ftw_path: Path, device: str, dtype) -> None:
    """The compact block as a GPU tier receives it (raw bytes in a uint8 tensor on the device)
    decodes there to exactly the host decode of the same block: every codec, zstd blocks too."""
    with FTWFile(ftw_path) as f:
        for key in PLAN:
            stored = f.read_expert_bytes(*key)
            host = f.decode_stored(*key, stored, dtype)
            raw = f.raw_bytes(*key, stored)
            assert len(raw) == f.expert_info(*key).raw_length
            on_device = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
            decoded = f.decode_raw(*key, on_device, dtype)
            assert set(decoded) == set(host)
            for name, t in decoded.items():
                assert t.device.type == device and t.dtype == dtype
                assert torch.equal(t.cpu(), host[name]), (key, name)


def test_decode_raw_rejects_bytes_of_the_wrong_length(ftw_path: Path) -> None:
    with FTWFile(ftw_path) as f:
        raw = torch.frombuffer(bytearray(f.raw_bytes(0, 0, f.read_expert_bytes(0, 0))), dtype=torch.uint8)
        with pytest.raises(FTWFormatError, match="raw bytes must be"):
            f.decode_raw(0, 0, raw[:-1])


def test_corrupt_dense_detected_by_verify(ftw_path: Path) -> None:
    with FTWFile(ftw_path) as f:
        off = f.dense_info("embed.weight").offset
    _flip(ftw_path, off + 10)
    with FTWFile(ftw_path) as f:
        f.dense("embed.weight")  # unverified access is zero-cost and does not check
        with pytest.raises(FTWFormatError, match=f"byte offset {off}"):
            f.dense("embed.weight", verify=True)
        with pytest.raises(FTWFormatError, match="embed.weight"):
            f.verify()


@pytest.mark.parametrize("keep", [10, 4096, 9000, -1])
def test_truncated_file(ftw_path: Path, keep: int) -> None:
    size = os.path.getsize(ftw_path)
    with open(ftw_path, "r+b") as fh:
        fh.truncate(size + keep if keep < 0 else keep)
    with pytest.raises(FTWFormatError, match="truncated") as ei:
        FTWFile(ftw_path)
    assert str(ftw_path) in str(ei.value) and "byte offset" in str(ei.value)


def test_wrong_magic(ftw_path: Path) -> None:
    with open(ftw_path, "r+b") as fh:
        fh.write(b"GGUF")
    with pytest.raises(FTWFormatError, match="not an FTW file") as ei:
        FTWFile(ftw_path)
    assert str(ftw_path) in str(ei.value) and "byte offset 0" in str(ei.value)


def test_not_an_ftw_file(tmp_path: Path) -> None:
    p = tmp_path / "x.ftw"
    p.write_bytes(b"hello")
    with pytest.raises(FTWFormatError, match="truncated or not an FTW file"):
        FTWFile(p)
    with pytest.raises(FTWFormatError, match="cannot open"):
        FTWFile(tmp_path / "missing.ftw")


def test_wrong_version(ftw_path: Path) -> None:
    data = bytearray(ftw_path.read_bytes())
    fields = list(HEADER_STRUCT.unpack_from(data))
    fields[1] = 2  # major
    head = HEADER_STRUCT.pack(*fields)
    data[: len(head) + 8] = head + struct.pack("<Q", xxhash.xxh64_intdigest(head))
    ftw_path.write_bytes(bytes(data))
    with pytest.raises(FTWFormatError, match="version 2.0"):
        FTWFile(ftw_path)


def test_bad_header_checksum(ftw_path: Path) -> None:
    _flip(ftw_path, 20)  # inside manifest_offset
    with pytest.raises(FTWFormatError, match="header checksum"):
        FTWFile(ftw_path)


def test_bad_manifest_checksum(ftw_path: Path) -> None:
    m_off, m_len = HEADER_STRUCT.unpack_from(ftw_path.read_bytes())[5:7]
    _flip(ftw_path, m_off + m_len // 2)
    with pytest.raises(FTWFormatError, match="manifest checksum") as ei:
        FTWFile(ftw_path)
    assert f"byte offset {m_off}" in str(ei.value)


def test_unknown_keys(ftw_path: Path) -> None:
    with FTWFile(ftw_path) as f:
        with pytest.raises(FTWFormatError, match=r"layer=7, expert=0"):
            f.decode_expert(7, 0)
        with pytest.raises(FTWFormatError, match="layer=0, expert=9"):
            f.expert_info(0, 9)
        with pytest.raises(FTWFormatError, match="nope"):
            f.dense("nope")


def test_atomic_write(tmp_path: Path) -> None:
    path = tmp_path / "m.ftw"
    with pytest.raises(RuntimeError, match="boom"):
        with FTWWriter(path, model_config={}) as w:
            w.add_dense("x", torch.ones(3))
            w.add_expert(0, 0, _expert_encoded(0, 0))
            raise RuntimeError("boom")
    assert not path.exists() and not (tmp_path / "m.ftw.tmp").exists()
    # A failed rewrite leaves an existing good file untouched.
    with FTWWriter(path, model_config={"v": 1}) as w:
        w.add_dense("x", torch.ones(3))
    with pytest.raises(RuntimeError):
        with FTWWriter(path, model_config={"v": 2}) as w:
            raise RuntimeError("boom")
    with FTWFile(path) as f:
        assert f.model_config == {"v": 1} and torch.equal(f.dense("x"), torch.ones(3))


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="JSON"):
        FTWWriter(tmp_path / "a.ftw", model_config={"x": object()})
    w = FTWWriter(tmp_path / "b.ftw", model_config={})
    try:
        w.add_dense("x", torch.ones(2))
        with pytest.raises(ValueError, match="twice"):
            w.add_dense("x", torch.ones(2))
        with pytest.raises(ValueError, match="dtype"):
            w.add_dense("c", torch.ones(2, dtype=torch.complex64))
        w.add_expert(0, 0, _expert_encoded(0, 0))
        with pytest.raises(ValueError, match="twice"):
            w.add_expert(0, 0, _expert_encoded(0, 0))
        with pytest.raises(ValueError, match="layer"):
            w.add_expert(-1, 0, _expert_encoded(0, 0))
        bad = EncodedTensor("mxfp4", (4, 64), {"blocks": torch.zeros(4, 2, 16, dtype=torch.uint8)})
        with pytest.raises(ValueError, match="parts"):
            w.add_expert(0, 1, {"gate": bad})
    finally:
        w.abort()
    assert not (tmp_path / "b.ftw").exists() and not (tmp_path / "b.ftw.tmp").exists()


def test_wrapped_gpt_oss_weights_stored_bit_exact(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(9)
    blocks = torch.randint(0, 256, (2, 64, 2, 16), dtype=torch.uint8, generator=g)  # [E, out, in/32, 16]
    scales = torch.randint(115, 135, (2, 64, 2), dtype=torch.uint8, generator=g)
    path = tmp_path / "oss.ftw"
    with FTWWriter(path, model_config={}) as w:
        for e in range(2):
            w.add_expert(0, e, {"gate_up": wrap_mxfp4(blocks[e], scales[e])}, compress=e == 1)
    with FTWFile(path) as f:
        for e in range(2):
            enc = f.encoded_expert(0, e)["gate_up"]
            assert torch.equal(enc.parts["blocks"], blocks[e]) and torch.equal(enc.parts["scales"], scales[e])
            assert enc.shape == (64, 64)
