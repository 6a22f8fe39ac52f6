"""Does a setup fit the modelled machine? Fast memory, dense weights and the KV cache of the trace's
context must fit the device (a CPU-only machine: all of it, tier 2 too, in RAM), else the replay
would predict a machine that cannot load the model.

Tier 1's budget is in the bytes tier 1 really holds (`machine.tier1_codec`: on a GPU an int8 or fp8
expert is held as bf16), so a share of the experts (`tier1_share_bytes`) is taken of those bytes,
not of the stored codec's."""

from __future__ import annotations

from .machine import tier1_codec
from .profiles import HardwareProfile
from .replay import SimulationError
from .shapes import ModelShape, codec_name

GiB = 1024**3


class FitError(SimulationError):
    """A setup that does not fit the modelled machine (`check_fits`); one line naming what."""


def tier1_share_bytes(shape: ModelShape, profile: HardwareProfile, codec: str, share: float) -> int:
    """Tier-1 bytes that hold `share` (0..1) of every routed expert in the form tier 1 holds them."""
    return int(share * shape.total_expert_bytes(tier1_codec(codec_name(codec), profile.device)))


def check_fits(
    shape: ModelShape,
    profile: HardwareProfile,
    *,
    fast_bytes: int,
    host_bytes: int | None,
    dense_codec: str,
    context: int,
) -> None:
    """FitError (one line: the machine, what each part needs, the total) unless fast memory + the
    dense weights in `dense_codec` + the KV cache of `context` tokens (bf16) fit `device_mem_bytes`
    (and `host_bytes` fits `host_mem_bytes`); on a "cpu" profile all of them and `host_bytes`
    together fit `host_mem_bytes`."""
    dense = shape.dense_resident_bytes(dense_codec)
    kv = shape.kv_bytes(context)
    parts = [
        ("fast memory", fast_bytes),
        (f"dense weights ({dense_codec})", dense),
        (f"KV of {context} tokens", kv),
    ]
    if profile.device == "cpu":
        parts.append(("tier 2", host_bytes or 0))
        room, where = profile.host_mem_bytes, "RAM"
    else:
        room, where = profile.device_mem_bytes, "device memory"
        if host_bytes is not None and host_bytes > profile.host_mem_bytes:
            raise FitError(
                f"tier 2 of {host_bytes / GiB:.1f} GiB does not fit {profile.name}'s "
                f"{profile.host_mem_bytes / GiB:.1f} GiB of RAM"
            )
    need = sum(n for _, n in parts)
    if need > room:
        what = " + ".join(f"{name} {n / GiB:.1f}" for name, n in parts if n)
        raise FitError(
            f"{shape.name} does not fit {profile.name}'s {room / GiB:.1f} GiB of {where}: "
            f"{what} = {need / GiB:.1f} GiB"
        )
