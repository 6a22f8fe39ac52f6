"""CPU matmuls from a codec's stored bytes (issue 60): which candidate is fastest, and which keeps
the codec's numbers.

    python bench/cpu_codec_kernels.py            # ~3 min on 2 cores
    python bench/cpu_codec_kernels.py --quick    # ~40 s: two shapes, T = 1 and 8, fewer repeats
    python bench/cpu_codec_kernels.py --json out.json --threads 2

For expert-sized weights [N, K] (Qwen3-30B-A3B gate_up [1536, 2048] and down [2048, 768],
Mixtral-8x7B w1 [14336, 4096], the issue's ~0.5B Mixtral-shaped peer gate_up [4096, 768]) held in
the FTW codecs (`int8_b32` = GGUF Q8_0, `uint4_b32` = Q4_0/Q4_1/Q4_K, `int8` per channel, `mxfp4`),
built by the repository's own encoders and GGUF converters, it times ``y = x @ W.T`` at T = 1
(decode GEMV), 8 and 64 tokens with each candidate:

  (a) dense fp32 / dense bf16: the codec decoded whole at load (today's path), then ``F.linear``.
  (b) ``torch._weight_int8pack_mm`` (int8 weights, one scale per output row, bf16 activations on
      AVX2: its fp32 form is a scalar loop). ``int8``: unit kernel scales, the fp32 row scale
      applied after (as `kernels/int8.py`). ``int8_b32`` (a scale per 32 weights) has no exact
      per-row form: either one kernel call per 32-column block on a [K/32, N, 32] re-layout of the
      same bytes, the partial products scaled and summed in fp32 (exact weights), or the Q8_0
      values re-quantized to per-row int8 at load (an approximation, measured).
  (c) ``torch.ops.aten._weight_int4pack_mm_for_cpu`` with group size 32 for ``uint4_b32``. Its
      weight is ``(q - 8) * scale + zero`` per (row, 32-group) (aten/src/ATen/native/cpu/
      int4mm_kernel.cpp; AVX2 computes ``fma(q, s, fma(s, -8, z))`` in fp32), so the codec's
      ``q * scale + min`` maps onto ``scale = scale, zero = min + 8 * scale``. The scales and zeros
      have the activations' dtype: bf16 (the vectorised AVX2 path) rounds them; fp32 keeps them
      but runs a scalar loop. N must be a multiple of 16.
  (d) block decode: `BLOCK_ELEMS` weights (whole rows) decoded at a time into a reused fp32
      scratch that stays in L2, each block multiplied by ``torch.mm`` into its rows of the output.
      The decode is the codec's own arithmetic, so the values are the codec's bit for bit.
  (e) own kernels: numba (when importable; not a dependency of the package; compiled once into a
      cache under the temp dir) fusing the decode into a GEMV/GEMM that reads each stored byte
      once per call, and ``torch.compile`` (inductor's C++ codegen, gcc at run time) of the decode
      written as a reduction, at T = 1 only (a compile per shape, its seconds printed).

torchao: its pypi wheel (0.18) ships CUDA extensions only; its CPU int4 layout calls (c), and its
da8w4 CPU kernel is not in that wheel, so it adds no candidate here (``torchao_status``).
mxfp4 has no (b)/(c) form: E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6) are not affine in the code.

Each candidate is prepared from the stored parts (a load-time re-layout at most, never a float
copy, except (a)) and replicated until its copies exceed the L3 cache, and the copies are cycled:
a decode step reads experts from DRAM (the Mixtral weight repeats 2048 encoded rows: same bytes
per row, a fraction of the setup). Candidates run round-robin, one call each per round, so load
from other processes lands on all of them alike. Columns: median and fastest ms per matmul, the
median process CPU ms of the same calls, bytes held per weight, GB/s of the held bytes (at the
median), speed against dense fp32 and dense bf16 of the same shape and T measured in the same
rounds (x > 1: faster), and the output's largest error against the float64 product of the codec's
decoded weights (first 1024 rows), relative to the largest output. On a loaded machine a 2-thread
median is inflated by preemption (a parallel region waits for its descheduled thread, spinning:
CPU ms then equals wall ms); read the fastest call, or run ``--threads 1`` and read CPU ms.

The exactness section then, for each codec and each GGUF type it holds, probes every candidate
with unit activations (x = I) to read back the weights it computes with, and compares them bit
for bit with the codec's decode; and compares T = 8 and T = 1 outputs with the float64 reference,
against the float32 summation bound (K + 2) * 2**-24 * (|x| @ |W|.T). `exactness_rows` is what
tests/test_cpu_codec_kernels_bench.py runs.

Letters: T tokens, K input features, N output features.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

QBLOCK = 32
BLOCK_ELEMS = 1 << 18
"""Weights decoded at once by (d): 1 MiB of fp32, the two cores' L2 (each thread decodes and
multiplies its half of the rows). 2**16 was 1.2-1.8x slower at T = 1 in a trial (a decode and a
``torch.mm`` launch per 16-32 rows), 2**20 no faster."""
WORKING_SET = 64 << 20
"""Bytes of weight copies each candidate cycles over: twice the L3 (32 MiB) of the 2-core EPYC."""
MAX_COPIES = 64
TOKENS = (1, 8, 64)
SHAPES: dict[str, tuple[int, int]] = {
    "qwen3-30b-a3b gate_up": (1536, 2048),
    "qwen3-30b-a3b down": (2048, 768),
    "0.5B peer gate_up": (4096, 768),
    "mixtral-8x7b w1": (14336, 4096),
}
QUICK_SHAPES = ("qwen3-30b-a3b gate_up", "0.5B peer gate_up")
CODECS = ("int8_b32", "uint4_b32", "int8", "mxfp4")
SOURCES = {
    # exactness sources: codec -> the GGUF types it holds, plus the codec's own encoder ("own")
    "int8_b32": ("Q8_0", "own"),
    "uint4_b32": ("Q4_0", "Q4_1", "Q4_K", "own"),
    "int8": ("own",),
    "mxfp4": ("own",),
}
U_FP32 = 2.0**-24


# ---------------------------------------------------------------------------------------------
# The repository's codecs, found wherever the engine's modules live now (they are moving from the
# engine's root into subpackages; the bench should survive the move).


def engine_module(suffix: str) -> Any:
    """The `freetoken_agents.engine` module whose path ends with `suffix` (``"codecs.py"``,
    ``"gguf/quants.py"``), or the package ``codecs/`` that replaced such a module, imported by its
    dotted name under the engine package (its modules move into subpackages; searching keeps the
    bench working across the moves)."""
    import freetoken_agents.engine as engine

    root = Path(engine.__path__[0])
    package = "/" + suffix.removesuffix(".py") + "/__init__.py"
    hits = [p for p in root.rglob("*.py") if p.as_posix().endswith(("/" + suffix, package))]
    if len(hits) != 1:
        raise ImportError(f"expected one engine module ending in {suffix!r}, found {hits}")
    parts = hits[0].relative_to(root).with_suffix("").parts
    dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return importlib.import_module(f"freetoken_agents.engine.{dotted}")


def codecs() -> Any:
    return engine_module("codecs.py")


def decode(enc: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return codecs().get_codec(enc.codec).decode(enc, dtype)


def _gguf_encoded(qtype_name: str, n: int, k: int, rng: np.random.Generator) -> Any:
    """A [n, k] weight as GGUF `qtype_name` bytes (gguf-py's quantizer; Q4_K: random valid super
    blocks, as tests/gguf_models.py, since gguf-py does not quantize K types), converted by the
    repository's GGUF loader into its kept codec."""
    import gguf

    quants = engine_module("gguf/quants.py")
    reader = engine_module("gguf/reader.py")
    qtype = gguf.GGMLQuantizationType[qtype_name]
    if qtype_name == "Q4_K":
        m = n * (k // 256)
        d = (rng.uniform(0.5, 1.5, m) * 2e-4).astype(np.float16).view(np.uint8).reshape(m, 2)
        dmin = (rng.uniform(0.5, 1.5, m) * 1e-3).astype(np.float16).view(np.uint8).reshape(m, 2)
        scales = rng.integers(0, 256, (m, 12), dtype=np.uint8)
        qs = rng.integers(0, 256, (m, 128), dtype=np.uint8)
        data = np.concatenate([d, dmin, scales, qs], axis=1).reshape(n, -1)
    else:
        data = gguf.quants.quantize((rng.standard_normal((n, k)) * 0.02).astype(np.float32), qtype)
    where = Path("bench.gguf")
    enc = quants.encoded_weight(reader.GGUFTensor("blk.0.ffn_gate.weight", qtype, (n, k), data, where), where)
    if enc.codec != quants.kept_codec(qtype_name):
        raise RuntimeError(f"{qtype_name} converted to {enc.codec}, expected {quants.kept_codec(qtype_name)}")
    return enc


REF_ROWS = 1024
"""Output rows checked against the float64 reference in the timing runs (all rows: exactness)."""
TILE_ROWS = 2048
"""Rows encoded for the timing weights; taller weights repeat them (the codec's bytes all the same;
speed does not depend on the values, and encoding Mixtral's 58M weights four times took ~40 s)."""


def _rows(enc: Any, rows: int) -> Any:
    """The first `rows` rows of `enc` (every codec's parts are row-major with rows first)."""
    n, k = enc.shape
    if rows >= n:
        return enc
    parts = {name: p[:rows].contiguous() for name, p in enc.parts.items()}
    return type(enc)(enc.codec, (rows, k), parts)


def tiled_encoded(codec: str, n: int, k: int, seed: int = 1) -> Any:
    """A [n, k] weight in `codec` for timing: `TILE_ROWS` rows from the codec's encoder, repeated."""
    enc = make_encoded(codec, min(n, TILE_ROWS), k, "own", seed)
    if n <= TILE_ROWS:
        return enc
    reps = math.ceil(n / TILE_ROWS)
    parts = {name: p.repeat(reps, *([1] * (p.dim() - 1)))[:n].contiguous() for name, p in enc.parts.items()}
    return type(enc)(codec, (n, k), parts)


def make_encoded(codec: str, n: int, k: int, source: str = "own", seed: int = 0) -> Any:
    """A [n, k] weight in `codec`: from the codec's own encoder (``source="own"``, random normal
    values of an expert's scale) or from GGUF bytes of type `source` via the GGUF converter."""
    rng = np.random.default_rng(seed)
    if source != "own":
        return _gguf_encoded(source, n, k, rng)
    w = torch.from_numpy((rng.standard_normal((n, k)) * 0.02).astype(np.float32))
    return codecs().get_codec(codec).encode(w)


# ---------------------------------------------------------------------------------------------
# Candidates. `prepare` turns the stored parts into what the candidate holds (at load); `run`
# computes y [T, N] float32 from x [T, K] float32 and that state.

State = dict[str, Any]


@dataclass
class Candidate:
    key: str
    label: str
    codec: str | None  # None: the dense baselines (any codec, from its decoded weights)
    prepare: Callable[[Any], State]
    run: Callable[[torch.Tensor, State], torch.Tensor]
    exact: bool  # computes with the codec's decoded weights bit for bit, fp32 activations/sums
    note: str
    max_tokens: int = 1 << 30  # timed only up to this T (scalar paths)
    approx_rel: float = 0.0  # not exact: the output error it is held to (relative to max |ref|)
    exact_sources: tuple[str, ...] | None = None  # exact only for these sources (None: all)
    held: Callable[[State], torch.Tensor] | None = None  # the weights its arithmetic uses, if known


def _held_bytes(st: State) -> int:
    return sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))


_ONES: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def _ones(n: int, dtype: torch.dtype) -> torch.Tensor:
    key = (n, dtype)
    if key not in _ONES:
        _ONES[key] = torch.ones(n, dtype=dtype)
    return _ONES[key]


def _act(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Activations for the int8/int4 kernels: contiguous, 64-byte aligned rows (their vector
    loops load activation rows aligned; K is a multiple of 32, so only the base can be off)."""
    xa = x.to(dtype).contiguous()
    if xa.data_ptr() % 64:
        xa = xa.clone()
    return xa


# (a) dense ----------------------------------------------------------------------------------


def _prep_dense(dtype: torch.dtype) -> Callable[[Any], State]:
    return lambda enc: {"w": decode(enc, dtype).contiguous()}


def _run_dense_fp32(x: torch.Tensor, st: State) -> torch.Tensor:
    return F.linear(x, st["w"])


def _run_dense_bf16(x: torch.Tensor, st: State) -> torch.Tensor:
    return F.linear(x.to(torch.bfloat16), st["w"]).float()


# (b) _weight_int8pack_mm --------------------------------------------------------------------


def _prep_int8(enc: Any) -> State:
    return {"q": enc.parts["weight"], "s": enc.parts["scale"]}


def _run_int8pack(dtype: torch.dtype) -> Callable[[torch.Tensor, State], torch.Tensor]:
    def run(x: torch.Tensor, st: State) -> torch.Tensor:
        q = st["q"]
        y = torch._weight_int8pack_mm(_act(x, dtype), q, _ones(q.shape[0], dtype))  # sum x * q
        return torch.mul(y, st["s"])  # the row scale in fp32, after the kernel

    return run


def _prep_q8_blocks(enc: Any) -> State:
    """int8_b32 -> one [N, 32] int8 matrix per 32-column block ([K/32, N, 32], the same bytes laid
    out so that each block is contiguous) and the fp16 scales transposed [K/32, N]."""
    n, k = enc.shape
    q = enc.parts["weight"].view(n, k // QBLOCK, QBLOCK).transpose(0, 1).contiguous()
    return {"q": q, "s": enc.parts["scale"].t().contiguous()}


def _run_q8_blocks(dtype: torch.dtype) -> Callable[[torch.Tensor, State], torch.Tensor]:
    def run(x: torch.Tensor, st: State) -> torch.Tensor:
        q, s = st["q"], st["s"]
        nb, n, _ = q.shape
        t = x.shape[0]
        xb = _act(x, dtype).view(t, nb, QBLOCK).transpose(0, 1).contiguous()  # [nb, T, 32]
        ones = _ones(n, dtype)
        parts = torch.stack([torch._weight_int8pack_mm(xb[b], q[b], ones) for b in range(nb)])
        return (parts.float() * s.float()[:, None, :]).sum(0)  # block scales in fp32

    return run


def _prep_q8_requant(enc: Any) -> State:
    """Q8_0 values re-quantized at load to per-row int8 (the `int8` codec's encoder)."""
    requant = codecs().get_codec("int8").encode(decode(enc))
    return {"q": requant.parts["weight"], "s": requant.parts["scale"]}


def _held_int8(st: State) -> torch.Tensor:
    return st["q"].float() * st["s"][:, None]


# (c) _weight_int4pack_mm_for_cpu -------------------------------------------------------------


def _prep_int4pack(dtype: torch.dtype) -> Callable[[Any], State]:
    def prep(enc: Any) -> State:
        n, k = enc.shape
        blocks, scales, mins = enc.parts["blocks"], enc.parts["scales"], enc.parts["mins"]
        codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(n, k).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        s = scales.to(dtype)
        # zero such that the kernel's fma(s, -8, zero) lands on min: rounded once, with the
        # scale the kernel will use (bf16 rounds both; fp32 keeps them: min + 8s is exact for
        # GGUF values, an fp16 or a 17-bit scale times 8 plus an fp16 min)
        z = (mins.double() + 8.0 * s.double()).to(dtype)
        sz = torch.stack([s.t(), z.t()], dim=-1).contiguous()  # [K/32, N, 2]
        return {"packed": packed, "sz": sz}

    return prep


def _run_int4pack(dtype: torch.dtype) -> Callable[[torch.Tensor, State], torch.Tensor]:
    def run(x: torch.Tensor, st: State) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(_act(x, dtype), st["packed"], QBLOCK, st["sz"])
        return y.float()

    return run


# (d) block decode into an L2-sized scratch ---------------------------------------------------

_SCRATCH: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def _scratch(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    buf = _SCRATCH.get((name, dtype))
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[(name, dtype)] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


_U4_PAIRS: torch.Tensor | None = None
_MX_PAIRS: torch.Tensor | None = None


def _mx_pairs() -> torch.Tensor:
    """[65536] int64: entry ``s * 256 + b`` holds byte b's two E2M1 values (low nibble first) times
    the E8M0 scale 2**(s - 127) as float32 (NaN for s = 255): the codec's products (exact), so
    one gather per stored byte gives the decoded pair."""
    global _MX_PAIRS
    if _MX_PAIRS is None:
        values = torch.tensor(codecs().MXFP4_VALUES, dtype=torch.float64)
        b = torch.arange(256)
        pairs = torch.stack([values[b & 0x0F], values[b >> 4]], dim=1)  # [256, 2]
        scale = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - 127)
        scale[255] = float("nan")
        table = (scale[:, None, None] * pairs[None]).float().contiguous()  # [s, b, 2]
        _MX_PAIRS = table.view(torch.int64).view(-1)
    return _MX_PAIRS


def _u4_pairs() -> torch.Tensor:
    """[256] int64: byte -> its two codes as float32 (low nibble first), one gather moves both."""
    global _U4_PAIRS
    if _U4_PAIRS is None:
        b = torch.arange(256)
        _U4_PAIRS = torch.stack([b & 0x0F, b >> 4], dim=1).float().contiguous().view(torch.int64).view(-1)
    return _U4_PAIRS


def _decode_rows(codec: str, st: State, r0: int, r1: int, k: int) -> torch.Tensor:
    """Rows r0:r1 of the weight decoded into the scratch, fp32 [r, K], with the codec's decode
    arithmetic (same operations, same roundings: bit-equal to `Codec.decode`)."""
    r = r1 - r0
    w = _scratch("w", r * k, torch.float32)
    if codec == "int8_b32":
        w3 = w.view(r, k // QBLOCK, QBLOCK).copy_(st["q"][r0:r1].view(r, -1, QBLOCK))
        w3.mul_(st["s32"][r0:r1, :, None])
    elif codec == "int8":
        w.view(r, k).copy_(st["q"][r0:r1]).mul_(st["s"][r0:r1, None])
    elif codec == "uint4_b32":
        idx = _scratch("idx", r * k // 2, torch.int32).copy_(st["blocks"][r0:r1].reshape(-1))
        torch.index_select(_u4_pairs(), 0, idx, out=w.view(torch.int64))
        w3 = w.view(r, k // QBLOCK, QBLOCK)
        w3.mul_(st["scales"][r0:r1, :, None]).add_(st["mins"][r0:r1, :, None])  # as the codec
    elif codec == "mxfp4":
        table = _mx_pairs()
        nb = k // QBLOCK
        sidx = _scratch("sidx", r * nb, torch.int32).view(r, nb, 1)
        sidx.copy_(st["scales"][r0:r1].view(r, nb, 1)).mul_(256)
        idx = _scratch("idx", r * k // 2, torch.int32).view(r, nb, QBLOCK // 2)
        torch.add(st["blocks"][r0:r1], sidx, out=idx)  # table entry: scale byte * 256 + byte
        torch.index_select(table, 0, idx.view(-1), out=w.view(torch.int64))
    else:
        raise ValueError(codec)
    return w.view(r, k)


def _prep_block(codec: str) -> Callable[[Any], State]:
    def prep(enc: Any) -> State:
        p = enc.parts
        if codec == "int8_b32":  # fp16 scales widened once (exact): +1/16 byte a weight
            return {"q": p["weight"], "s32": p["scale"].float()}
        if codec == "int8":
            return {"q": p["weight"], "s": p["scale"]}
        if codec == "uint4_b32":
            return {"blocks": p["blocks"], "scales": p["scales"], "mins": p["mins"]}
        return {"blocks": p["blocks"], "scales": p["scales"]}

    return prep


def _run_block(codec: str) -> Callable[[torch.Tensor, State], torch.Tensor]:
    def run(x: torch.Tensor, st: State) -> torch.Tensor:
        t, k = x.shape
        n = st["q"].shape[0] if "q" in st else st["blocks"].shape[0]
        rows = max(1, min(n, BLOCK_ELEMS // k))
        out_t = torch.empty(n, t)  # transposed output: each row block is a contiguous slice
        xt = x.t()
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            torch.mm(_decode_rows(codec, st, r0, r1, k), xt, out=out_t[r0:r1])
        return out_t.t()

    return run


# (e) own kernels: numba ----------------------------------------------------------------------

_NUMBA: dict[str, Any] | None = None
NUMBA_ROWS = 8  # output rows per parallel work item


def numba_kernels() -> dict[str, Any] | None:
    """The numba kernels (compiled on first call), or None when numba is not importable.

    Each work item takes `NUMBA_ROWS` output rows; per row and 32-weight block it decodes the block
    into 32 fp32 lanes (the codec's arithmetic: numba's fastmath here allows reassociation but not
    contraction, so ``q * s + m`` rounds as the codec's decode does) and accumulates
    ``x[t, block] * w`` lane-wise for every token, the lanes summed at the end of the row: the
    stored bytes are read once per call whatever T is. uint4/mxfp4 take the activations permuted
    per block (even features, then odd) so the low and high nibbles meet contiguous lanes; loop
    bounds are runtime values (the block size is an argument): LLVM unrolled constant 16- and
    32-trip loops fully and then left them scalar."""
    global _NUMBA
    if _NUMBA is not None:
        return _NUMBA or None
    if importlib.util.find_spec("numba") is None:
        _NUMBA = {}
        return None
    # compiled kernels are cached outside the checkout (a first compile takes ~10-30 s); the
    # config is set too, since numba reads the variable once, at its first import
    cache_dir = os.environ.setdefault(
        "NUMBA_CACHE_DIR", str(Path(tempfile.gettempdir()) / "freetoken-numba-cache")
    )
    import numba
    from numba import njit, prange

    numba.config.CACHE_DIR = numba.config.CACHE_DIR or cache_dir

    fm = {"reassoc", "nsz", "arcp", "nnan", "ninf"}
    rb = NUMBA_ROWS

    @njit(parallel=True, fastmath=fm, cache=True)
    def int8_blocks(x, q, s, bs, out):  # pragma: no cover - compiled
        t_n, k = x.shape
        n = q.shape[0]
        ns = s.shape[1]
        nb = k // bs
        for c in prange((n + rb - 1) // rb):
            acc = np.empty((t_n, bs), np.float32)
            w = np.empty(bs, np.float32)
            for row in range(c * rb, min(n, c * rb + rb)):
                qr = q[row]
                sr = s[row]
                acc[:] = 0
                for b in range(nb):
                    sb = sr[(b * ns) // nb]
                    o = b * bs
                    for j in range(bs):
                        w[j] = np.float32(qr[o + j]) * sb
                    for t in range(t_n):
                        xr = x[t]
                        a = acc[t]
                        for j in range(bs):
                            a[j] += xr[o + j] * w[j]
                for t in range(t_n):
                    out[t, row] = acc[t].sum()

    @njit(parallel=True, fastmath=fm, cache=True)
    def uint4_blocks(xp, blocks, sc, mn, out):  # pragma: no cover - compiled
        t_n, k = xp.shape
        n = blocks.shape[0]
        nb = sc.shape[1]
        hb = blocks.shape[1] // nb
        for c in prange((n + rb - 1) // rb):
            acc = np.empty((t_n, 2 * hb), np.float32)
            w = np.empty(2 * hb, np.float32)
            for row in range(c * rb, min(n, c * rb + rb)):
                br = blocks[row]
                acc[:] = 0
                for b in range(nb):
                    s = sc[row, b]
                    m = mn[row, b]
                    ob = b * hb
                    for j in range(hb):
                        w[j] = np.float32(br[ob + j] & np.uint8(15)) * s + m
                        w[hb + j] = np.float32(br[ob + j] >> np.uint8(4)) * s + m
                    o = 2 * ob
                    for t in range(t_n):
                        xr = xp[t]
                        a = acc[t]
                        for j in range(2 * hb):
                            a[j] += xr[o + j] * w[j]
                for t in range(t_n):
                    out[t, row] = acc[t].sum()

    @njit(parallel=True, fastmath=fm, cache=True)
    def mxfp4_blocks(xp, blocks, scales, e2m1, e8m0, out):  # pragma: no cover - compiled
        t_n, k = xp.shape
        n = blocks.shape[0]
        nb = scales.shape[1]
        hb = blocks.shape[1] // nb
        for c in prange((n + rb - 1) // rb):
            acc = np.empty((t_n, 2 * hb), np.float32)
            w = np.empty(2 * hb, np.float32)
            for row in range(c * rb, min(n, c * rb + rb)):
                br = blocks[row]
                acc[:] = 0
                for b in range(nb):
                    s = e8m0[scales[row, b]]
                    ob = b * hb
                    for j in range(hb):
                        w[j] = e2m1[br[ob + j] & np.uint8(15)] * s
                        w[hb + j] = e2m1[br[ob + j] >> np.uint8(4)] * s
                    o = 2 * ob
                    for t in range(t_n):
                        xr = xp[t]
                        a = acc[t]
                        for j in range(2 * hb):
                            a[j] += xr[o + j] * w[j]
                for t in range(t_n):
                    out[t, row] = acc[t].sum()

    # T = 1 (decode): the block's weights go straight into the lane-wise FMA, no scratch
    # round trip (~1.3x faster than the kernels above at T = 1 in a 1-thread trial)
    @njit(parallel=True, fastmath=fm, cache=True)
    def int8_gemv(x, q, s, bs, out):  # pragma: no cover - compiled
        k = x.shape[1]
        n = q.shape[0]
        ns = s.shape[1]
        nb = k // bs
        xr = x[0]
        for c in prange((n + rb - 1) // rb):
            acc = np.empty(bs, np.float32)
            for row in range(c * rb, min(n, c * rb + rb)):
                qr = q[row]
                sr = s[row]
                acc[:] = 0
                for b in range(nb):
                    sb = sr[(b * ns) // nb]
                    o = b * bs
                    for j in range(bs):
                        acc[j] += xr[o + j] * (np.float32(qr[o + j]) * sb)
                out[0, row] = acc.sum()

    @njit(parallel=True, fastmath=fm, cache=True)
    def uint4_gemv(xp, blocks, sc, mn, out):  # pragma: no cover - compiled
        n = blocks.shape[0]
        nb = sc.shape[1]
        hb = blocks.shape[1] // nb
        xr = xp[0]
        for c in prange((n + rb - 1) // rb):
            acc = np.empty(2 * hb, np.float32)
            for row in range(c * rb, min(n, c * rb + rb)):
                br = blocks[row]
                acc[:] = 0
                for b in range(nb):
                    s = sc[row, b]
                    m = mn[row, b]
                    ob = b * hb
                    o = 2 * ob
                    for j in range(hb):
                        v = br[ob + j]
                        acc[j] += xr[o + j] * (np.float32(v & np.uint8(15)) * s + m)
                        acc[hb + j] += xr[o + hb + j] * (np.float32(v >> np.uint8(4)) * s + m)
                out[0, row] = acc.sum()

    @njit(parallel=True, fastmath=fm, cache=True)
    def mxfp4_gemv(xp, blocks, scales, e2m1, e8m0, out):  # pragma: no cover - compiled
        n = blocks.shape[0]
        nb = scales.shape[1]
        hb = blocks.shape[1] // nb
        xr = xp[0]
        for c in prange((n + rb - 1) // rb):
            acc = np.empty(2 * hb, np.float32)
            for row in range(c * rb, min(n, c * rb + rb)):
                br = blocks[row]
                acc[:] = 0
                for b in range(nb):
                    s = e8m0[scales[row, b]]
                    ob = b * hb
                    o = 2 * ob
                    for j in range(hb):
                        v = br[ob + j]
                        acc[j] += xr[o + j] * (e2m1[v & np.uint8(15)] * s)
                        acc[hb + j] += xr[o + hb + j] * (e2m1[v >> np.uint8(4)] * s)
                out[0, row] = acc.sum()

    _NUMBA = {
        "version": numba.__version__,
        "set_threads": numba.set_num_threads,
        "int8_blocks": int8_blocks,
        "uint4_blocks": uint4_blocks,
        "mxfp4_blocks": mxfp4_blocks,
        "int8_gemv": int8_gemv,
        "uint4_gemv": uint4_gemv,
        "mxfp4_gemv": mxfp4_gemv,
    }
    return _NUMBA


def _even_odd(x: torch.Tensor) -> np.ndarray:
    """x [T, K] with each 32-block's even features first, then its odd ones (the nibble order)."""
    t, k = x.shape
    return x.view(t, k // QBLOCK, QBLOCK // 2, 2).transpose(-1, -2).contiguous().view(t, k).numpy()


def _prep_numba(codec: str) -> Callable[[Any], State]:
    def prep(enc: Any) -> State:
        p = enc.parts
        n, k = enc.shape
        if codec == "int8_b32":  # fp16 scales widened once (numba has no fp16 arithmetic)
            return {"q": p["weight"], "s": p["scale"].float()}
        if codec == "int8":
            return {"q": p["weight"], "s": p["scale"].view(n, 1)}
        if codec == "uint4_b32":
            return {"blocks": p["blocks"].view(n, k // 2), "scales": p["scales"], "mins": p["mins"]}
        return {"blocks": p["blocks"].view(n, k // 2), "scales": p["scales"]}

    return prep


_MX_TABLES: tuple[np.ndarray, np.ndarray] | None = None


def _mx_tables() -> tuple[np.ndarray, np.ndarray]:
    global _MX_TABLES
    if _MX_TABLES is None:
        c = codecs()
        e8m0 = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - 127)
        e8m0[255] = float("nan")
        _MX_TABLES = (np.array(c.MXFP4_VALUES, dtype=np.float32), e8m0.float().numpy())
    return _MX_TABLES


def _run_numba(codec: str) -> Callable[[torch.Tensor, State], torch.Tensor]:
    def run(x: torch.Tensor, st: State) -> torch.Tensor:
        kern = numba_kernels()
        assert kern is not None
        form = "gemv" if x.shape[0] == 1 else "blocks"
        n = st["q"].shape[0] if "q" in st else st["blocks"].shape[0]
        out = np.empty((x.shape[0], n), dtype=np.float32)
        if codec in ("int8_b32", "int8"):
            kern[f"int8_{form}"](x.contiguous().numpy(), st["q"].numpy(), st["s"].numpy(), QBLOCK, out)
        elif codec == "uint4_b32":
            args = (st["blocks"].numpy(), st["scales"].numpy(), st["mins"].numpy(), out)
            kern[f"uint4_{form}"](_even_odd(x), *args)
        else:
            e2m1, e8m0 = _mx_tables()
            kern[f"mxfp4_{form}"](_even_odd(x), st["blocks"].numpy(), st["scales"].numpy(), e2m1, e8m0, out)
        return torch.from_numpy(out)

    return run


# ---------------------------------------------------------------------------------------------
# (e) own kernels: torch.compile --------------------------------------------------------------


def _gemv_int8_b32(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    w = q.view(n, k // QBLOCK, QBLOCK).float() * s[:, :, None]
    return (x.view(x.shape[0], 1, k // QBLOCK, QBLOCK) * w[None]).sum((-2, -1))


def _gemv_uint4_b32(
    x: torch.Tensor, blocks: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor
) -> torch.Tensor:
    # written without interleaving the nibbles (a stack made inductor write the whole fp32
    # weight out first): x is split into even and odd features instead
    t = x.shape[0]
    nb = sc.shape[1]
    lo = (blocks & 15).float() * sc[:, :, None] + mn[:, :, None]
    hi = (blocks >> 4).float() * sc[:, :, None] + mn[:, :, None]
    xp = x.view(t, 1, nb, QBLOCK // 2, 2)
    return (xp[..., 0] * lo[None] + xp[..., 1] * hi[None]).sum((-2, -1))


_COMPILED: dict[tuple[str, tuple[int, ...]], Any] = {}
COMPILE_SECONDS: dict[str, float] = {}


def _prep_compile(codec: str) -> Callable[[Any], State]:
    def prep(enc: Any) -> State:
        p = enc.parts
        if codec == "int8_b32":
            return {"q": p["weight"], "s": p["scale"].float()}
        return {"blocks": p["blocks"], "scales": p["scales"], "mins": p["mins"]}

    return prep


def _run_compile(codec: str) -> Callable[[torch.Tensor, State], torch.Tensor]:
    def run(x: torch.Tensor, st: State) -> torch.Tensor:
        import torch._dynamo

        tensors = (st["q"], st["s"]) if codec == "int8_b32" else (st["blocks"], st["scales"], st["mins"])
        key = (codec, tuple(x.shape), *(tuple(t.shape) for t in tensors))
        fn = _COMPILED.get(key)
        if fn is None:
            torch._dynamo.config.cache_size_limit = 256  # one compile per shape, no silent eager
            if hasattr(torch._dynamo.config, "recompile_limit"):
                torch._dynamo.config.recompile_limit = 256
            base = _gemv_int8_b32 if codec == "int8_b32" else _gemv_uint4_b32
            fn = torch.compile(base, dynamic=False, fullgraph=True)
            t0 = time.perf_counter()
            fn(x, *tensors)
            COMPILE_SECONDS[f"{codec} {list(key[1])} x {list(key[2])}"] = time.perf_counter() - t0
            _COMPILED[key] = fn
        return fn(x, *tensors)

    return run


# ---------------------------------------------------------------------------------------------

BF16_REL = 2.0**-5
"""Error held to by candidates with bf16 activations or outputs, relative to the largest output:
bf16 keeps 8 significant bits (a 2**-9 relative rounding per value), and the errors of a K-long
sum of random-sign terms grow like sqrt(K) against a sum that grows like sqrt(K) as well, so
measured errors sit near 2**-8; a wrong layout or formula gives errors near 1."""


def candidates(numba_ok: bool | None = None) -> list[Candidate]:
    """Every candidate, the dense baselines first."""
    if numba_ok is None:
        numba_ok = numba_kernels() is not None
    bf16, fp32 = torch.bfloat16, torch.float32
    out = [
        Candidate(
            "dense_fp32",
            "(a) dense fp32 (decoded at load)",
            None,
            _prep_dense(fp32),
            _run_dense_fp32,
            exact=True,
            note="today's path: 4 bytes a weight",
        ),
        Candidate(
            "dense_bf16",
            "(a) dense bf16 (decoded at load)",
            None,
            _prep_dense(bf16),
            _run_dense_bf16,
            exact=False,
            note="bf16 weights round Q8_0/Q4 values (8-bit significand)",
            approx_rel=BF16_REL,
            held=lambda st: st["w"].float(),
        ),
        # (b)
        Candidate(
            "int8pack_bf16",
            "(b) int8pack, bf16 act",
            "int8",
            _prep_int8,
            _run_int8pack(bf16),
            exact=False,
            note="weights exact; activations and kernel output rounded to bf16",
            approx_rel=BF16_REL,
        ),
        Candidate(
            "int8pack_fp32",
            "(b) int8pack, fp32 act",
            "int8",
            _prep_int8,
            _run_int8pack(fp32),
            exact=True,
            note="exact, but a scalar loop on AVX2",
            max_tokens=1,
        ),
        Candidate(
            "q8_blocks_bf16",
            "(b) int8pack per 32-block, bf16 act",
            "int8_b32",
            _prep_q8_blocks,
            _run_q8_blocks(bf16),
            exact=False,
            note="K/32 kernel calls; weights exact, bf16 act and partials",
            approx_rel=BF16_REL,
            max_tokens=8,  # 6-10x slower than dense fp32 at T = 64 in the first runs
        ),
        Candidate(
            "q8_blocks_fp32",
            "(b) int8pack per 32-block, fp32 act",
            "int8_b32",
            _prep_q8_blocks,
            _run_q8_blocks(fp32),
            exact=True,
            note="K/32 scalar kernel calls",
            max_tokens=1,
        ),
        Candidate(
            "q8_requant",
            "(b) Q8_0 re-quantized per row, int8pack bf16",
            "int8_b32",
            _prep_q8_requant,
            _run_int8pack(bf16),
            exact=False,
            note="changes the weights: per-row int8 re-encoding at load",
            approx_rel=BF16_REL,
            held=_held_int8,
        ),
        # (c)
        Candidate(
            "int4pack_bf16",
            "(c) int4pack g32, bf16 act/scales",
            "uint4_b32",
            _prep_int4pack(bf16),
            _run_int4pack(bf16),
            exact=False,
            note="scale and min+8*scale rounded to bf16",
            approx_rel=BF16_REL,
            held=lambda st: _int4pack_held(st, bf16),
        ),
        Candidate(
            "int4pack_fp32",
            "(c) int4pack g32, fp32 act/scales",
            "uint4_b32",
            _prep_int4pack(fp32),
            _run_int4pack(fp32),
            exact=True,
            note="a scalar loop on AVX2; exact where (q-8)*scale is",
            max_tokens=1,
            exact_sources=("Q4_0", "Q4_1", "Q4_K"),
            # other fp32 scales: (q - 8) * scale rounds, one fp32 rounding more per weight
            approx_rel=2.0**-18,
        ),
    ]
    for codec in CODECS:  # (d)
        out.append(
            Candidate(
                f"block_{codec}",
                "(d) block decode + mm",
                codec,
                _prep_block(codec),
                _run_block(codec),
                exact=True,
                note=f"{BLOCK_ELEMS} weights a block, fp32 scratch",
            )
        )
    if numba_ok:
        for codec in CODECS:
            out.append(
                Candidate(
                    f"numba_{codec}",
                    "(e) numba fused kernel",
                    codec,
                    _prep_numba(codec),
                    _run_numba(codec),
                    exact=True,
                    note="decode in registers, bytes read once",
                )
            )
    for codec in ("int8_b32", "uint4_b32"):
        out.append(
            Candidate(
                f"compile_{codec}",
                "(e) torch.compile fused GEMV",
                codec,
                _prep_compile(codec),
                _run_compile(codec),
                exact=True,
                note="inductor C++; compiled per shape",
                max_tokens=1,
            )
        )
    return out


def _int4pack_held(st: State, dtype: torch.dtype) -> torch.Tensor:
    """The weights the AVX2 int4pack kernel computes with: fma(q, s, fma(s, -8, z)) in fp32 from
    the held scale and zero (float64 holds each fma's exact value, rounded once to fp32)."""
    sz = st["sz"].double()  # [K/32, N, 2]
    s, z = sz[..., 0].t(), sz[..., 1].t()  # [N, K/32]
    zero = (s * -8.0 + z).float().double()
    codes = st["codes_for_held"]  # [N, K/32, 32]
    return (codes.double() * s[..., None] + zero[..., None]).float().reshape(codes.shape[0], -1)


# ---------------------------------------------------------------------------------------------
# Exactness


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().T


def _fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The float32 forward error bound of any summation order: gamma_(K+2) * |x| @ |W|.T (the K
    products and sums, plus one scale applied after the sum)."""
    k = x.shape[1]
    g = (k + 2) * U_FP32 / (1 - (k + 2) * U_FP32)
    return g * (x.double().abs() @ w.double().abs().T)


def probe_weights(cand: Candidate, st: State, k: int) -> torch.Tensor:
    """The weights a candidate computes with, read back through the candidate itself with unit
    activations (x = I: each output is one weight times 1.0 plus zeros, exact in fp32 and bf16;
    a kernel whose output is bf16 rounds the weight to bf16)."""
    return cand.run(torch.eye(k), st).float().T.contiguous()


def exactness_rows(
    n: int = 128, k: int = 512, tokens: int = 8, seed: int = 0, numba_ok: bool | None = None
) -> list[dict[str, Any]]:
    """For each codec and each source it holds (`SOURCES`), each candidate's read-back weights
    against the codec's decode and its T-token output against the float64 reference."""
    rows = []
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g)
    cands = [c for c in candidates(numba_ok) if not c.key.startswith("compile_")]
    for codec in CODECS:
        for source in SOURCES[codec]:
            enc = make_encoded(codec, n, k, source, seed)
            w = decode(enc)
            ref = _reference(x, w)
            bound = _fp32_bound(x, w)
            scale = float(ref.abs().max())
            wmax = float(w.abs().max())
            for cand in cands:
                if cand.codec not in (None, codec):
                    continue
                st = cand.prepare(enc)
                if cand.key.startswith("int4pack"):
                    st["codes_for_held"] = torch.stack(
                        [enc.parts["blocks"] & 0x0F, enc.parts["blocks"] >> 4], dim=-1
                    ).reshape(n, k // QBLOCK, QBLOCK)
                probed = probe_weights(cand, st, k)
                held = cand.held(st) if cand.held is not None else probed
                # T tokens, and T = 1 apart: some candidates take another code path for decode
                err = (cand.run(x, st).double() - ref).abs()
                err1 = (cand.run(x[:1], st).double() - ref[:1]).abs()
                claims = cand.exact and (cand.exact_sources is None or source in cand.exact_sources)
                rows.append(
                    {
                        "codec": codec,
                        "source": source,
                        "candidate": cand.key,
                        "label": cand.label,
                        "claims_exact": claims,
                        "approx_rel": cand.approx_rel,
                        "held_bit_exact": bool(torch.equal(held, w)),
                        "probe_bit_exact": bool(torch.equal(probed, w)),
                        "held_max_rel": float((held - w).abs().max()) / wmax,
                        "held_rms_rel": float(
                            (held - w).double().pow(2).mean().sqrt() / w.double().pow(2).mean().sqrt()
                        ),
                        "probe_max_rel": float((probed - w).abs().max()) / wmax,
                        "probe_vs_held_bf16": bool(torch.equal(probed, held.to(torch.bfloat16).float())),
                        "out_max_rel": max(float(err.max()), float(err1.max())) / scale,
                        "within_fp32_bound": bool((err <= bound).all() and (err1 <= bound[:1]).all()),
                        "note": cand.note,
                    }
                )
    return rows


# ---------------------------------------------------------------------------------------------
# Timing


@dataclass
class Entry:
    cand: Candidate
    copies: list[State]
    held_bytes: int
    enc_bytes: int
    ref: torch.Tensor | None = None
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # process CPU seconds of the same calls
    turn: int = 0
    max_reps: int = 0
    err: float = float("nan")
    skipped: str = ""


def _copies(st: State, held: int) -> list[State]:
    n = max(2, min(MAX_COPIES, math.ceil(WORKING_SET / max(held, 1))))
    out = [st]
    for _ in range(n - 1):
        out.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()})
    return out


def time_shape(
    name: str,
    n: int,
    k: int,
    tokens: tuple[int, ...],
    reps: int,
    cell_budget: float,
    use_compile: bool,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Median time of every candidate on [n, k] at each T, round-robin (one call each per round)."""
    t_setup = time.perf_counter()
    encs = {codec: tiled_encoded(codec, n, k) for codec in CODECS}
    decoded = {codec: decode(_rows(enc, REF_ROWS)) for codec, enc in encs.items()}
    entries: list[tuple[str, Entry]] = []
    for cand in candidates():
        if cand.key.startswith("compile_") and not use_compile:
            continue
        codec = cand.codec or "int8_b32"  # the dense baselines: any codec's decoded weights
        st = cand.prepare(encs[codec])
        held = _held_bytes(st)
        entries.append((codec, Entry(cand, _copies(st, held), held, encs[codec].nbytes)))
    log(f"  setup {time.perf_counter() - t_setup:.1f} s")
    results = []
    g = torch.Generator().manual_seed(2)
    for t in tokens:
        x = torch.randn(t, k, generator=g)
        refs = {codec: _reference(x, w) for codec, w in decoded.items()}  # first REF_ROWS outputs
        live = []
        for codec, e in entries:
            e.times, e.cpu, e.turn, e.skipped = [], [], 0, ""
            if t > e.cand.max_tokens:
                e.skipped = f"only T <= {e.cand.max_tokens}"
                continue
            y = e.cand.run(x, e.copies[0])[:, :REF_ROWS].double()  # warm-up (and (e)'s compile)
            ref = refs[codec]
            e.err = float((y - ref).abs().max() / ref.abs().max())
            c0, t0 = time.process_time(), time.perf_counter()
            e.cand.run(x, e.copies[1 % len(e.copies)])
            second, second_cpu = time.perf_counter() - t0, time.process_time() - c0
            e.max_reps = max(3, min(reps, int(cell_budget / max(second, 1e-6))))
            if second > cell_budget:  # a slow candidate: this call is its one sample
                e.times, e.cpu = [second], [second_cpu]
                e.max_reps = 1
            live.append((codec, e))
        for _ in range(reps):
            for _, e in live:
                if len(e.times) >= e.max_reps:
                    continue
                st = e.copies[e.turn % len(e.copies)]
                e.turn += 1
                c0, t0 = time.process_time(), time.perf_counter()
                e.cand.run(x, st)
                e.times.append(time.perf_counter() - t0)
                e.cpu.append(time.process_time() - c0)
        base = {}
        for _, e in live:
            if e.cand.codec is None:
                base[e.cand.key] = statistics.median(e.times)
        for _, e in entries:
            ms = statistics.median(e.times) * 1e3 if e.times else float("nan")
            results.append(
                {
                    "shape": name,
                    "n": n,
                    "k": k,
                    "tokens": t,
                    "codec": e.cand.codec or "-",
                    "candidate": e.cand.key,
                    "label": e.cand.label,
                    "ms": ms,
                    "min_ms": min(e.times) * 1e3 if e.times else float("nan"),
                    # CPU time of all threads: under load (other processes on the cores) a
                    # 1-thread run's CPU ms is the figure that preemption does not inflate
                    "cpu_ms": statistics.median(e.cpu) * 1e3 if e.cpu else float("nan"),
                    "reps": len(e.times),
                    "held_bytes_per_weight": e.held_bytes / (n * k),
                    "gbps_held": e.held_bytes / (ms * 1e6) if e.times else float("nan"),
                    "vs_fp32": base["dense_fp32"] * 1e3 / ms if e.times else float("nan"),
                    "vs_bf16": base["dense_bf16"] * 1e3 / ms if e.times else float("nan"),
                    "out_max_rel": e.err if e.times else float("nan"),
                    "skipped": e.skipped,
                }
            )
        log(f"  T={t} done")
    return results


# ---------------------------------------------------------------------------------------------
# Report


def torchao_status() -> str:
    try:
        import torchao  # noqa: F401
    except ImportError:
        return (
            "torchao not installed (pypi 0.18 wheel checked with pip download: CUDA extensions "
            "only; its CPU int4 path is (c), its da8w4 CPU op is absent)"
        )
    return f"torchao {torchao.__version__} importable; its CPU int4 layout calls (c)"


def machine() -> dict[str, Any]:
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    kern = numba_kernels()
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "numba": kern["version"] if kern else "not importable",
        "torchao": torchao_status(),
        "python": platform.python_version(),
    }


def _fmt(v: float, digits: int = 2) -> str:
    if v != v:  # nan
        return "-"
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.{digits}f}"


def timing_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| codec | candidate | ms (median) | ms (min) | CPU ms | held B/w | GB/s held | vs fp32 | vs bf16 "
        "| max rel err |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["skipped"]:
            continue
        lines.append(
            f"| {r['codec']} | {r['label']} | {_fmt(r['ms'], 3)} | {_fmt(r['min_ms'], 3)} | "
            f"{_fmt(r['cpu_ms'], 3)} | "
            f"{_fmt(r['held_bytes_per_weight'], 3)} | {_fmt(r['gbps_held'], 1)} | "
            f"{_fmt(r['vs_fp32'])}x | {_fmt(r['vs_bf16'])}x | {r['out_max_rel']:.1e} |"
        )
    return "\n".join(lines)


def exactness_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| codec | source | candidate | weights held = decode | held max / rms rel | out max rel "
        "| in fp32 bound | claims exact |",
        "|---|---|---|---|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['codec']} | {r['source']} | {r['label']} | "
            f"{'bit-exact' if r['held_bit_exact'] else 'no'} | "
            f"{r['held_max_rel']:.1e} / {r['held_rms_rel']:.1e} | {r['out_max_rel']:.1e} | "
            f"{'yes' if r['within_fp32_bound'] else 'no'} | {'yes' if r['claims_exact'] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global BLOCK_ELEMS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two shapes, T = 1 and 8, fewer repeats (~40 s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", nargs="*", choices=sorted(SHAPES), help="only these shapes")
    ap.add_argument("--tokens", nargs="*", type=int, help=f"only these T (default {list(TOKENS)})")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile candidates")
    ap.add_argument("--block-elems", type=int, default=BLOCK_ELEMS, help="weights a block of (d) decodes")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    BLOCK_ELEMS = args.block_elems
    kern = numba_kernels()
    if kern:
        kern["set_threads"](args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    info = machine()
    info["threads"] = args.threads
    info["load_before"] = os.getloadavg()
    t_all = time.perf_counter()
    shapes = args.shapes or (list(QUICK_SHAPES) if args.quick else list(SHAPES))
    tokens = tuple(args.tokens) if args.tokens else (1, 8) if args.quick else TOKENS
    reps, budget = (7, 0.25) if args.quick else (15, 0.6)
    use_compile = not (args.quick or args.no_compile)
    with torch.inference_mode():
        t0 = time.perf_counter()
        exact = exactness_rows(*((64, 256) if args.quick else (128, 512)), numba_ok=kern is not None)
        info["exactness_seconds"] = time.perf_counter() - t0
        timing = []
        for name in shapes:
            n, k = SHAPES[name]
            log(f"{name} [{n}, {k}]")
            timing += time_shape(name, n, k, tokens, reps, budget, use_compile, log)
    info["load_after"] = os.getloadavg()
    info["seconds"] = time.perf_counter() - t_all
    info["compile_seconds"] = COMPILE_SECONDS

    print("# CPU codec kernels (bench/cpu_codec_kernels.py)\n")
    print(
        f"{info['cpu']}, {info['cores']} cores, {info['capability']}, torch {info['torch']}, "
        f"{args.threads} threads, numba {info['numba']}; {info['torchao']}. Load average before "
        f"{', '.join(f'{v:.2f}' for v in info['load_before'])}, after "
        f"{', '.join(f'{v:.2f}' for v in info['load_after'])}; {info['seconds']:.0f} s.\n"
    )
    for name in shapes:
        for t in tokens:
            rows = [r for r in timing if r["shape"] == name and r["tokens"] == t]
            n, k = SHAPES[name]
            print(f"## {name} [N={n}, K={k}], T={t}\n")
            print(timing_table(rows) + "\n")
    if COMPILE_SECONDS:
        print(
            "torch.compile first-call seconds: "
            + ", ".join(f"{k} {v:.1f}" for k, v in COMPILE_SECONDS.items())
        )
        print()
    n_ex, k_ex = (64, 256) if args.quick else (128, 512)
    print(f"## Exactness ([{n_ex}, {k_ex}], T=8; weights read back through each candidate with x = I)\n")
    print(exactness_table(exact))
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "timing": timing, "exactness": exact}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
