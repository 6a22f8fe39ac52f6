"""The modelled machine of a replay: what each step of a routed expert costs, and a timeline of
the resources that run those steps in parallel.

`ExpertCosts.of(shape, profile, codec)` prices one routed expert of `shape` on `profile`:
- tier 1 form: on a GPU MXFP4 experts stay compact (the engine's GEMV kernel, expert_quant
  "compact") and every other codec is decoded to bf16; on a CPU int8 and MXFP4 stay compact and
  fp32/bf16 are used as stored (fp8 is decoded to bf16);
- compute of T tokens on the device or the CPU: the larger of reading its weights once at the
  memory bandwidth and 2 x params x T FLOPs at the processor's rate (decode is weight-read bound);
- a disk read of its FTW block (tier 3 -> tier 2), a copy of its stored bytes over the host ->
  device link (latency included) and, on the GPU, a decode of the copied bytes at device memory
  speed; on a CPU-only machine "the link" is the decode into tier 1 (free for a block used as
  stored: its tier-1 form is a view);
- the activations a HOST computation moves (hidden in and out, bf16) and the dense part of one
  MoE layer's share of the token (attention, norms, router, lm_head: `dense_bytes_per_token`).

`Timeline` holds when each resource is next free: "device" (GPU compute), "cpu" (host compute),
"link" (host -> device copies) and "disk". On a CPU-only profile the device, the CPU and the link
are one resource (the cores do all three). A job starts when both its inputs and its resource
are ready, so copies overlap compute and the CPU works beside the GPU as far as the routing allows.
"""

from __future__ import annotations

from dataclasses import dataclass

from .profiles import HardwareProfile
from .shapes import ModelShape, codec_name

ACTIVATION_DTYPE_BYTES = 2  # bf16 hidden states cross the link


def tier1_codec(codec: str, device: str) -> str:
    """The codec an expert of `codec` is computed in from tier 1 on `device` ("cuda" or "cpu")."""
    c = codec_name(codec)
    if device == "cuda":
        return c if c == "mxfp4" else "bf16"
    return "bf16" if c.startswith("fp8") else c


def moves_whole(codec: str, device: str) -> bool:
    """Whether tier 1 holds an expert in its stored bytes (its bytes move up instead of being
    copied, with exclusive tiers): bf16 on a GPU; fp32, bf16 or int8 on a CPU."""
    c = codec_name(codec)
    return c == "bf16" if device == "cuda" else c in ("fp32", "bf16", "int8")


@dataclass(frozen=True)
class ExpertCosts:
    """What one routed expert costs on the modelled machine (seconds, bytes); see the module
    docstring. Compute at T tokens: `fast_compute_s(T)` (tier 1), `host_compute_s(T)` (CPU)."""

    device: str
    codec: str
    stored_bytes: int
    fast_bytes: int
    disk_s: float
    link_s: float
    decode_s: float
    activation_bytes: int
    activation_s: float
    dense_layer_s: float
    dense_layer_flops: float
    params: int
    device_bps: float
    device_flops: float
    host_bps: float
    host_flops: float

    @classmethod
    def of(cls, shape: ModelShape, profile: HardwareProfile, codec: str) -> ExpertCosts:
        c = codec_name(codec)
        dev = profile.device
        fast_codec = tier1_codec(c, dev)
        stored = shape.expert_bytes(c)
        fast = shape.expert_bytes(fast_codec)
        device_bps = profile.device_mem_gbps * 1e9
        lowp = fast_codec in ("int8", "fp8_e4m3")
        device_flops = (profile.device_lowp_tflops if lowp else profile.device_bf16_tflops) * 1e12
        host_bps, host_flops = profile.host_mem_gbps * 1e9, profile.cpu_gflops * 1e9
        if dev == "cuda":
            link_s = profile.link_seconds(stored)
            decode_s = 0.0 if fast_codec == c else (stored + fast) / device_bps
        else:  # the "link" is the decode into tier 1: a view when the block is used as stored
            link_s = 0.0 if moves_whole(c, dev) else (stored + fast) / host_bps
            decode_s = 0.0
        act = 2 * shape.hidden * ACTIVATION_DTYPE_BYTES
        n_moe = max(1, len(shape.moe_layers))
        dense_bytes = shape.dense_bytes_per_token("bf16") / n_moe
        dense_flops = shape.dense_flops_per_token() / n_moe
        return cls(
            device=dev,
            codec=c,
            stored_bytes=stored,
            fast_bytes=fast,
            disk_s=stored / (profile.disk_gbps * 1e9),
            link_s=link_s,
            decode_s=decode_s,
            activation_bytes=act,
            activation_s=profile.link_seconds(act, copies=2) if dev == "cuda" else 0.0,
            dense_layer_s=dense_bytes / device_bps,
            dense_layer_flops=dense_flops,
            params=shape.expert_params(),
            device_bps=device_bps,
            device_flops=device_flops,
            host_bps=host_bps,
            host_flops=host_flops,
        )

    def fast_compute_s(self, tokens: int) -> float:
        return max(self.fast_bytes / self.device_bps, 2 * self.params * tokens / self.device_flops)

    def host_compute_s(self, tokens: int) -> float:
        return max(self.stored_bytes / self.host_bps, 2 * self.params * tokens / self.host_flops)

    def dense_s(self, tokens: int) -> float:
        """One MoE layer's share of the dense part of a step of `tokens` tokens."""
        return max(self.dense_layer_s, self.dense_layer_flops * tokens / self.device_flops)


class Timeline:
    """When each resource ("device", "cpu", "link", "disk") is next free, and how long each was
    busy. On a CPU-only machine ("cpu" profile) the device, the CPU and the link are one resource."""

    RESOURCES = ("device", "cpu", "link", "disk")

    def __init__(self, device: str) -> None:
        self.alias = {"device": "cpu", "link": "cpu"} if device == "cpu" else {}
        self.free = {r: 0.0 for r in self.RESOURCES}
        self.busy = {r: 0.0 for r in self.RESOURCES}

    def run(self, resource: str, ready: float, seconds: float) -> float:
        """Run a job of `seconds` on `resource` once `ready` (its inputs) and the resource are;
        returns when it ends."""
        r = self.alias.get(resource, resource)
        start = max(self.free[r], ready)
        self.free[r] = start + seconds
        self.busy[r] += seconds
        return self.free[r]
