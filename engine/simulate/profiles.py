"""Hardware profiles for the simulator: the links, memories and compute of a modelled machine.

A `HardwareProfile` holds the figures a decode-speed model needs. Built-ins (`BUILTIN_PROFILES`)
cite their source beside each figure: a spec sheet, a whitepaper, ``measured: FACTS.md`` (the
project's measurements of the H200 machine) or ``estimate`` (with how it was reached). Rates are
decimal: 1 GB/s = 1e9 bytes/s; sizes are bytes. Everything is a figure a user can replace by writing
a TOML file with every field (`load_profile`), for example a 4090 box with 128 GB of RAM:

    name = "my-4090"
    device = "cuda"              # "cuda", or "cpu" for a machine without a GPU
    link_gbps = 25.0             # host -> device copy from pinned memory, GB/s
    link_latency_us = 10.0       # fixed cost of one small copy, microseconds
    device_mem_gbps = 1008.0     # device memory bandwidth, GB/s
    device_mem_bytes = 25_757_220_864
    device_bf16_tflops = 165.2   # dense tensor-core bf16 (fp32 accumulate)
    device_lowp_tflops = 330.3   # dense fp8 (or int8) tensor-core figure
    host_mem_gbps = 70.0
    host_mem_bytes = 137_438_953_472
    disk_gbps = 5.0
    cpu_gflops = 1000.0          # sustained fp32 GFLOP/s, all cores
    cpu_cores = 16

Five fixed costs are optional, in microseconds: `layer_overhead_us` (per transformer layer per
step besides reading its weights: op launches, Python around norms, attention, the router) and
`expert_overhead_us` (per routed expert call: its ops and the Python around them), default 0: not
modelled; and the engine's own bookkeeping, which only the policies run through its tiered
provider pay (qstar, qstar-profiled, layer-lru): `tier_overhead_us` (per MoE layer of a tiered
step: bookkeeping and pre-gating), `miss_overhead_us` (per routed expert a tiered step finds
outside tier 1: q*'s decision and the Python around computing it where its weights are) and
`stream_overhead_us` (per STREAM on top of that: the promotion into tier 1 and the eviction and
demotion it causes), default None: the engine's measured figures (`engine_costs.MEASURED`, for
the model's layer shape); 0 prices one at nothing. `measure_profile` measures
them on the machine it runs on, and two optional rates: `host_int8_gbps` and `host_mxfp4_gbps`,
how fast the CPU runs int8 / MXFP4 experts with the engine's kernels (default 0: as fast as
reading their bytes, `host_mem_gbps`).

For ``device = "cpu"`` the device IS the host: its memory figures are the host's, the link is a
memory copy (copy bandwidth) and its compute the CPU's; `fast` and host tiers then share one RAM.

Every figure must be finite and within what a machine can have (`RANGES`): rates 0.001 to 100,000
GB/s (1 MB/s to 20x HBM3e), bf16/low-precision matrix throughput 1e-6 to 1e5 TFLOP/s, the CPU
0.001 to 1e7 GFLOP/s and 1 to 65,536 cores, memories 1 MiB to 1 PiB, the link's latency 1 ns to
1 s, an optional overhead 0 or 1 ps to 1 s. (A denormal `link_gbps = 1e-320` passed "positive" and
ended the replay in a StopIteration traceback.) A profile file is at most 64 KiB of UTF-8 TOML;
what it cannot be read as is a ProfileError naming file:line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from ..errors import EngineError
from .profile_toml import failing_line, key_lines, toml_module

__all__ = ["BUILTIN_PROFILES", "HardwareProfile", "ProfileError", "load_profile"]

GiB = 1024**3
MiB = 1024**2


class ProfileError(EngineError, ValueError):
    """A hardware profile file or name that cannot be used; the message names the file and key."""


@dataclass(frozen=True)
class HardwareProfile:
    """The figures of one modelled machine (see the module docstring for units).

    Attributes:
        name: profile name.
        device: "cuda" (a GPU behind a host link) or "cpu" (no GPU: the device is the host).
        link_gbps: host -> device copy bandwidth from pinned host memory, GB/s (effective).
        link_latency_us: fixed cost of one small host -> device copy (launch, sync), microseconds.
        device_mem_gbps: device memory bandwidth, GB/s.
        device_mem_bytes: device memory, bytes.
        device_bf16_tflops: dense bf16 matrix throughput of the device, TFLOP/s.
        device_lowp_tflops: dense low-precision (fp8 or int8) matrix throughput, TFLOP/s.
        host_mem_gbps: host memory bandwidth, GB/s.
        host_mem_bytes: host memory, bytes.
        disk_gbps: disk read bandwidth for expert-sized reads that bypass the page cache, GB/s.
        cpu_gflops: sustained fp32 GFLOP/s of the CPU, all cores.
        cpu_cores: CPU cores.
        layer_overhead_us: fixed cost of one transformer layer in one step besides its weights
            (op launches, Python), microseconds; optional, default 0.
        expert_overhead_us: fixed cost of one routed expert call, microseconds; optional, default 0.
        tier_overhead_us: fixed cost per MoE layer of a tiered step (bookkeeping, pre-gating),
            microseconds; optional, default None: the engine's measured figure
            (`engine_costs.priced`), 0: not priced.
        miss_overhead_us: fixed cost per routed expert a tiered step finds outside tier 1 (the
            decision, and computing it where its weights are), microseconds; optional, default
            None as `tier_overhead_us`.
        stream_overhead_us: fixed cost a STREAM adds to `miss_overhead_us` (the promotion into
            tier 1, the eviction and demotion it causes), microseconds; optional, default None
            as `tier_overhead_us`.
        host_int8_gbps, host_mxfp4_gbps: the CPU's rate through int8 / MXFP4 expert weights on
            one token with the engine's own kernels, GB/s of those weights; optional, default 0:
            weight-read bound at host_mem_gbps (what a fused kernel reaches on a desktop CPU).
            Measured by `measure_profile`: on the 2-core Xeon dev machine the int8 kernel reads
            ~11 GB/s where fp32 reads 28, and MXFP4 is decoded before its matmul.
        host_efficiency: the share of `host_mem_gbps` a CPU's expert (and, on a "cpu" profile,
            dense) GEMV reaches for codecs without a measured rate above; optional, default 0: not
            modelled, the full bandwidth. Real engines reach 35-70% (FACTS.md: llama.cpp on
            desktops ~52-70%, ktransformers on an 8-channel server ~35-45%, a PyTorch bf16 CPU
            path ~20%).
    """

    name: str
    device: Literal["cuda", "cpu"]
    link_gbps: float
    link_latency_us: float
    device_mem_gbps: float
    device_mem_bytes: int
    device_bf16_tflops: float
    device_lowp_tflops: float
    host_mem_gbps: float
    host_mem_bytes: int
    disk_gbps: float
    cpu_gflops: float
    cpu_cores: int
    layer_overhead_us: float = 0.0
    expert_overhead_us: float = 0.0
    tier_overhead_us: float | None = None
    miss_overhead_us: float | None = None
    stream_overhead_us: float | None = None
    host_int8_gbps: float = 0.0
    host_mxfp4_gbps: float = 0.0
    host_efficiency: float = 0.0

    def __post_init__(self) -> None:
        for key, value in _validate(_as_dict(self), f"profile {self.name!r}").items():
            object.__setattr__(self, key, value)  # ints given for float figures become floats

    def link_seconds(self, nbytes: int, copies: int = 1) -> float:
        """Time to copy `nbytes` host -> device in `copies` transfers (latency paid per transfer)."""
        return copies * self.link_latency_us * 1e-6 + nbytes / (self.link_gbps * 1e9)

    def to_toml(self) -> str:
        """This profile as a TOML document `load_profile` reads back."""
        lines = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:  # TOML has no null: a key left out reads back as None
                continue
            lines.append(f"{f.name} = " + (f'"{v}"' if isinstance(v, str) else repr(v)))
        return "\n".join(lines) + "\n"


_TYPES: dict[str, type] = {
    "name": str,
    "device": str,
    "link_gbps": float,
    "link_latency_us": float,
    "device_mem_gbps": float,
    "device_mem_bytes": int,
    "device_bf16_tflops": float,
    "device_lowp_tflops": float,
    "host_mem_gbps": float,
    "host_mem_bytes": int,
    "disk_gbps": float,
    "cpu_gflops": float,
    "cpu_cores": int,
    "layer_overhead_us": float,
    "expert_overhead_us": float,
    "tier_overhead_us": float,
    "miss_overhead_us": float,
    "stream_overhead_us": float,
    "host_int8_gbps": float,
    "host_mxfp4_gbps": float,
    "host_efficiency": float,
}
_OPTIONAL: dict[str, float | None] = {
    "layer_overhead_us": 0.0,
    "expert_overhead_us": 0.0,
    "tier_overhead_us": None,
    "miss_overhead_us": None,
    "stream_overhead_us": None,
    "host_int8_gbps": 0.0,
    "host_mxfp4_gbps": 0.0,
    "host_efficiency": 0.0,
}
"""Keys a profile may leave out (their defaults), >= 0: fixed costs (0: not modelled; None: the
engine's measured bookkeeping, `engine_costs`) and the CPU's per-codec rates (0: at host_mem_gbps)."""
_DEVICES = ("cuda", "cpu")
_RATE, _US = (1e-3, 1e5, "GB/s"), (1e-6, 1e6, "us")
RANGES: dict[str, tuple[float, float, str]] = {
    "link_gbps": _RATE,
    "link_latency_us": (1e-3, 1e6, "us"),
    "device_mem_gbps": _RATE,
    "device_mem_bytes": (2**20, 2**50, "bytes"),
    "device_bf16_tflops": (1e-6, 1e5, "TFLOP/s"),
    "device_lowp_tflops": (1e-6, 1e5, "TFLOP/s"),
    "host_mem_gbps": _RATE,
    "host_mem_bytes": (2**20, 2**50, "bytes"),
    "disk_gbps": _RATE,
    "cpu_gflops": (1e-3, 1e7, "GFLOP/s"),
    "cpu_cores": (1, 2**16, "cores"),
    "layer_overhead_us": _US,
    "expert_overhead_us": _US,
    "tier_overhead_us": _US,
    "miss_overhead_us": _US,
    "stream_overhead_us": _US,
    "host_int8_gbps": _RATE,
    "host_mxfp4_gbps": _RATE,
    "host_efficiency": (0.01, 1.0, "of host_mem_gbps"),
}
"""Each figure's physical range (module docstring), inclusive; an optional figure may also be 0."""
MAX_PROFILE_BYTES = 64 * 1024
"""A profile file's largest size: a full profile with comments is ~1.5 KB."""


def _as_dict(p: HardwareProfile) -> dict[str, Any]:
    return {f.name: getattr(p, f.name) for f in fields(p)}


def _validate(
    doc: dict[str, Any], where: str, key_where: Callable[[str], str] | None = None
) -> dict[str, Any]:
    """`doc` with int figures widened to float where a float is expected; ProfileError naming
    `where` (or `key_where(key)`: the file and the key's line) and the first key at fault
    (unknown, missing, wrong type, non-positive, outside `RANGES`, bad device). Optional keys
    (`_OPTIONAL`) left out take their defaults and may be 0."""
    at = key_where or (lambda _key: where)
    unknown = sorted(set(doc) - set(_TYPES))
    if unknown:
        raise ProfileError(f"{at(unknown[0])}: unknown key {_short(unknown[0])} (keys: {', '.join(_TYPES)})")
    missing = [k for k in _TYPES if k not in doc and k not in _OPTIONAL]
    if missing:
        raise ProfileError(f"{where}: missing key {missing[0]!r}")
    out: dict[str, Any] = {}
    for key, kind in _TYPES.items():
        v, here = doc.get(key, _OPTIONAL.get(key)), at(key)
        if v is None and key in _OPTIONAL and _OPTIONAL[key] is None:
            out[key] = None  # left out: the engine's measured figure (`engine_costs.priced`)
            continue
        if kind is str:
            if not isinstance(v, str) or not v:
                raise ProfileError(f"{here}: key {key!r} must be a non-empty string, got {_short(v)}")
            out[key] = v
            continue
        if kind is int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ProfileError(f"{here}: key {key!r} must be an integer, got {_short(v)}")
        else:
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ProfileError(f"{here}: key {key!r} must be a number, got {_short(v)}")
            v = float(v)
            if not math.isfinite(v):
                raise ProfileError(f"{here}: key {key!r} must be finite, got {v!r}")
        if key in _OPTIONAL:
            if v < 0:
                raise ProfileError(f"{here}: key {key!r} must be >= 0, got {v!r}")
        elif v <= 0:
            raise ProfileError(f"{here}: key {key!r} must be positive, got {_short(v)}")
        lo, hi, unit = RANGES[key]
        if not (lo <= v <= hi or (v == 0 and key in _OPTIONAL)):
            zero = "0 or " if key in _OPTIONAL else ""
            raise ProfileError(f"{here}: key {key!r} must be {zero}{lo:g} to {hi:g} {unit}, got {_short(v)}")
        out[key] = v
    if out["device"] not in _DEVICES:
        raise ProfileError(
            f"{at('device')}: key 'device' must be one of {', '.join(_DEVICES)}, got {_short(out['device'])}"
        )
    return out


def _short(value: Any, limit: int = 60) -> str:
    """`value`'s repr cut to `limit` characters: an error stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


BUILTIN_PROFILES: dict[str, HardwareProfile] = {
    # A desktop RTX 4090 on PCIe 4.0 x16 with dual-channel DDR5.
    "rtx4090-pcie4": HardwareProfile(
        name="rtx4090-pcie4",
        device="cuda",
        # PCIe 4.0 x16 is 31.5 GB/s raw (16 GT/s x 16 lanes, 128b/130b); estimate 25 GB/s effective
        # pinned, ~0.8 of raw (the H200 machine measured 55 of PCIe 5's 63 GB/s: FACTS.md).
        link_gbps=25.0,
        # estimate: FACTS.md (H200) measured ~7.7 us per op launch and ~11.7 us per device sync.
        link_latency_us=10.0,
        # NVIDIA GeForce RTX 4090 spec sheet: 384-bit GDDR6X at 21 Gbps = 1008 GB/s, 24 GB.
        device_mem_gbps=1008.0,
        device_mem_bytes=24 * GiB,
        # NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): FP16/BF16 tensor, FP32 accumulate,
        # dense 165.2 TFLOPS; FP8 tensor, FP32 accumulate, dense 330.3 TFLOPS.
        device_bf16_tflops=165.2,
        device_lowp_tflops=330.3,
        # DDR5-5600 dual channel: 2 x 8 B x 5.6 GT/s = 89.6 GB/s peak; estimate 70 GB/s achieved.
        host_mem_gbps=70.0,
        # 64 GB (2 x 32 GB, the low end of 64-128 GB): write a TOML profile for more.
        host_mem_bytes=64 * GiB,
        # PCIe 4.0 NVMe spec sheets give ~7 GB/s sequential (Samsung 990 PRO: 7,450 MB/s);
        # estimate 5 GB/s for expert-sized O_DIRECT reads.
        disk_gbps=5.0,
        # estimate: 16-core desktop CPU (e.g. Ryzen 9 7950X, AVX-512 on Zen 4: ~2.5 TFLOP/s fp32
        # peak), ~40% sustained in GEMV-like loops.
        cpu_gflops=1000.0,
        cpu_cores=16,
        # layer/expert overheads: left 0 (see the h200 profile for the eager engine's); the tiered
        # provider's tier/miss/stream costs: the engine's measured ones (`engine_costs`).
    ),
    # A desktop RTX 5090 on PCIe 5.0 x16 with dual-channel DDR5.
    "rtx5090-pcie5": HardwareProfile(
        name="rtx5090-pcie5",
        device="cuda",
        # PCIe 5.0 x16 is 63 GB/s raw; measured: FACTS.md, 55 GB/s pinned H2D on the H200 machine's
        # PCIe 5 x16 link.
        link_gbps=55.0,
        link_latency_us=10.0,  # estimate, as rtx4090-pcie4
        # NVIDIA GeForce RTX 5090 spec sheet: 512-bit GDDR7 at 28 Gbps = 1792 GB/s, 32 GB.
        device_mem_gbps=1792.0,
        device_mem_bytes=32 * GiB,
        # NVIDIA RTX Blackwell GPU architecture whitepaper (RTX 5090): FP16/BF16 tensor, FP32
        # accumulate, dense 209.5 TFLOPS; FP8 tensor, FP32 accumulate, dense 419 TFLOPS (approx.).
        device_bf16_tflops=209.5,
        device_lowp_tflops=419.0,
        # DDR5-6000 dual channel: 96 GB/s peak; estimate 75 GB/s achieved.
        host_mem_gbps=75.0,
        host_mem_bytes=64 * GiB,
        # PCIe 5.0 NVMe spec sheets give 12-14 GB/s sequential; estimate 8 GB/s for expert reads.
        disk_gbps=8.0,
        cpu_gflops=1000.0,  # estimate, as rtx4090-pcie4
        cpu_cores=16,
        # layer/expert overheads: not measured, left 0; tier/miss/stream: measured (as rtx4090-pcie4).
    ),
    # The project's H200 machine (FACTS.md, measured 2026-12-04).
    "h200": HardwareProfile(
        name="h200",
        device="cuda",
        link_gbps=55.0,  # measured: FACTS.md, pinned host -> device copy, 25 and 256 MiB
        # measured: FACTS.md, ~7.7 us per tiny op launch, ~11.7 us per device -> host sync
        link_latency_us=10.0,
        # measured: FACTS.md, device-to-device copy ~4.3 TB/s (spec sheet: 4.8 TB/s HBM3e)
        device_mem_gbps=4300.0,
        device_mem_bytes=143_771 * MiB,  # measured: FACTS.md, 143,771 MiB (spec: 141 GB)
        # NVIDIA H200 SXM spec sheet: BF16 tensor 1,979 TFLOPS and FP8 3,958 with sparsity,
        # so 989.5 and 1,979 dense.
        device_bf16_tflops=989.5,
        device_lowp_tflops=1979.0,
        # estimate: not measured; a 16-core slice of a multi-channel DDR5 server.
        host_mem_gbps=100.0,
        host_mem_bytes=125 * 10**9,  # measured: FACTS.md, 125 GB RAM
        disk_gbps=1.9,  # measured: FACTS.md, 1.8-2.1 GB/s with O_DIRECT
        # estimate: not measured; 16 server cores with AVX-512 at ~2 GHz sustained, ~40% of peak.
        cpu_gflops=800.0,
        cpu_cores=16,  # measured: FACTS.md
        # Layer/expert overheads left 0, as on the other GPU profiles, so the cards compare on what
        # the memory policies allow (the tiered provider's own costs: measured, `engine_costs`).
        # FACTS.md measured what this engine pays today when it runs eagerly (a
        # tiered decode step does): the 4-layer Qwen3-30B-A3B shape at 120 tok/s where HBM allows
        # ~4,000, ~2 ms per layer of Python and launches, and 8 separate bf16 expert matmuls from
        # Python in 237 us; a TOML profile with layer_overhead_us = 1500 and expert_overhead_us =
        # 60 predicts today's eager engine instead (issue 31 is the work that removes them).
    ),
    # A desktop with no GPU: 16 cores and dual-channel DDR5 (the device is the host).
    "cpu-ddr5": HardwareProfile(
        name="cpu-ddr5",
        device="cpu",
        link_gbps=70.0,  # no link: a copy within RAM at host bandwidth
        link_latency_us=1.0,  # estimate: a small memcpy, no device launch
        device_mem_gbps=70.0,  # = host_mem_gbps
        device_mem_bytes=64 * GiB,  # = host_mem_bytes
        # estimate: the CPU itself (bf16 runs through fp32 math on AVX2/AVX-512 without AMX)
        device_bf16_tflops=1.0,
        device_lowp_tflops=1.0,
        # DDR5-5600 dual channel: 89.6 GB/s peak; estimate 70 GB/s achieved.
        host_mem_gbps=70.0,
        host_mem_bytes=64 * GiB,
        disk_gbps=5.0,  # estimate, PCIe 4.0 NVMe as rtx4090-pcie4
        cpu_gflops=1000.0,  # estimate, as rtx4090-pcie4
        cpu_cores=16,
        # layer/expert overheads: not measured on such a machine, left 0 (tier/miss/stream: the
        # engine's measured ones); `measure_profile` (``--profile-here``) measures them all on the
        # machine it runs on.
    ),
}
"""Built-in hardware profiles by name (sources beside each figure)."""


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A built-in profile by name, or the profile in a TOML file with every required `HardwareProfile`
    field (the optional overheads default to 0).

    ProfileError (a ValueError and an EngineError), in one line naming the file (file:line where
    there is one) and the key, for an unknown name, an unreadable or invalid TOML file (not UTF-8,
    past `MAX_PROFILE_BYTES`, nested past the parser's stack, an int past 4300 digits), and an
    unknown, missing, mistyped or non-positive key or one outside its `RANGES`.
    """
    key = str(name_or_path)
    if key in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[key]
    path = Path(name_or_path)
    if not path.is_file():
        raise ProfileError(
            f"unknown hardware profile {key!r}: not a built-in "
            f"({', '.join(BUILTIN_PROFILES)}) nor a TOML file"
        )
    toml = toml_module()
    if toml is None:
        raise ProfileError(f"{path}: reading TOML profiles needs Python 3.11+ or the tomli package")
    try:
        with path.open("rb") as f:
            data = f.read(MAX_PROFILE_BYTES + 1)
    except OSError as e:
        raise ProfileError(f"cannot read hardware profile {path}: {e.strerror or e}") from None
    if len(data) > MAX_PROFILE_BYTES:  # named at the line that runs past it
        line = data[:MAX_PROFILE_BYTES].count(b"\n") + 1
        raise ProfileError(f"{path}:{line}: past {MAX_PROFILE_BYTES} bytes: not a hardware profile")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ProfileError(f"{path}:{line}: not UTF-8 text (byte {data[e.start]:#04x})") from None
    try:
        doc = toml.loads(text)
    except toml.TOMLDecodeError as e:
        raise ProfileError(f"{path}: not valid TOML ({e})") from None
    except (RecursionError, ValueError) as e:  # nesting past the stack; an int past 4300 digits
        what = "nested too deeply" if isinstance(e, RecursionError) else "a number too long to read"
        raise ProfileError(f"{path}:{failing_line(toml, text)}: not a hardware profile: {what}") from None
    lines = key_lines(text)
    return HardwareProfile(
        **_validate(doc, str(path), lambda key: f"{path}:{lines[key]}" if key in lines else str(path))
    )
