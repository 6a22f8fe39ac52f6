"""The modelled machine of a replay: what each step of a routed expert costs, and a timeline of
the resources that run those steps in parallel.

`ExpertCosts.of(shape, profile, codec)` prices one routed expert of `shape` on `profile`:
- tier 1 form: on a GPU MXFP4 experts stay compact (the engine's GEMV kernel, expert_quant
  "compact") and every other codec is decoded to bf16; on a CPU int8 and MXFP4 stay compact and
  fp32/bf16 are used as stored (fp8 is decoded to bf16);
- compute of T tokens on the device or the CPU: the larger of reading its weights once at the
  memory bandwidth and 2 x params x T FLOPs at the processor's rate (decode is weight-read bound),
  plus the profile's fixed `expert_overhead_us` per expert call; int8 and MXFP4 weights on the
  CPU are read at the profile's measured kernel rate for the codec (`host_int8_gbps`,
  `host_mxfp4_gbps`) where it has one;
- a disk read of its FTW block (tier 3 -> tier 2), a copy of its stored bytes over the host ->
  device link (latency included) and, on the GPU, a decode of the copied bytes at device memory
  speed; on a CPU-only machine "the link" is the decode into tier 1: `expert_overhead_us` of
  bookkeeping, plus (stored + tier-1 bytes) at the copy bandwidth (`link_gbps`) when tier 1 gets a
  copy (a decode, or non-exclusive tiers: `promote_s`), nothing more for a block used in place;
- the activations a HOST computation moves (hidden in and out, bf16) and the dense part of one
  MoE layer's share of the token (attention, norms, router, lm_head: `dense_bytes_per_token`, in
  the compute dtype: bf16 on a GPU, fp32 on a CPU, where the engine keeps dense weights fp32),
  plus `layer_overhead_us` for each transformer layer (the model's layers / its MoE layers per
  MoE layer); a tiered step adds `tier_overhead_us` per MoE layer (`tier_overhead_s`),
  `miss_overhead_us` per expert it finds outside tier 1 (`miss_overhead_s`) and
  `stream_overhead_us` more per STREAM among them (`stream_overhead_s`: the tier moves), each the
  engine's measured figure where the profile names none (`engine_costs.priced`).

`Timeline` holds when each resource is next free: "device" (GPU compute), "cpu" (host compute),
"link" (host -> device copies) and "disk". On a CPU-only profile the device, the CPU and the link
are one resource (the cores do all three). A job starts when both its inputs and its resource
are ready, so copies overlap compute and the CPU works beside the GPU as far as the routing allows.
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine_costs import priced
from .profiles import HardwareProfile
from .shapes import GGUF_BITS, ModelShape, codec_name

ACTIVATION_DTYPE_BYTES = 2  # bf16 hidden states cross the link


def tier1_codec(codec: str, device: str) -> str:
    """The codec an expert of `codec` is computed in from tier 1 on `device` ("cuda" or "cpu")."""
    c = codec_name(codec)
    if c in GGUF_BITS:  # llama.cpp computes from the GGUF blocks on either device
        return c
    if device == "cuda":
        return c if c == "mxfp4" else "bf16"
    return "bf16" if c.startswith("fp8") else c


def moves_whole(codec: str, device: str) -> bool:
    """Whether tier 1 holds an expert in its stored bytes (its bytes move up instead of being
    copied, with exclusive tiers): bf16 on a GPU; fp32, bf16 or int8 on a CPU."""
    c = codec_name(codec)
    if c in GGUF_BITS:
        return True
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
    expert_overhead_s: float = 0.0
    layer_overhead_s: float = 0.0  # per MoE layer: every transformer layer's share
    tier_overhead_s: float = 0.0
    miss_overhead_s: float = 0.0
    stream_overhead_s: float = 0.0
    copy_s: float = 0.0  # CPU: a promotion that copies the block into tier 1 (CUDA: = link_s)
    host_codec_bps: float = 0.0  # the CPU's rate through the stored codec's weights (0: host_bps)
    fast_codec_bps: float = 0.0  # a "cpu" device's rate through tier 1's codec (0: device_bps)
    link_bps: float = 0.0  # CUDA: the host -> device link (`rows_copy_s`)
    link_latency_s: float = 0.0

    @classmethod
    def of(
        cls, shape: ModelShape, profile: HardwareProfile, codec: str, dense_codec: str | None = None
    ) -> ExpertCosts:
        """`dense_codec`: what the dense weights are held in (None: the engine's compute dtype,
        fp32 on a CPU and bf16 on a GPU; a GGUF's own, e.g. "q4_k_m", for llama.cpp's setups)."""
        c = codec_name(codec)
        dev = profile.device
        fast_codec = tier1_codec(c, dev)
        stored = shape.expert_bytes(c)
        fast = shape.expert_bytes(fast_codec)
        # What a CPU's GEMV reaches of its memory bandwidth (0: not modelled, all of it).
        efficiency = profile.host_efficiency or 1.0
        device_bps = profile.device_mem_gbps * 1e9 * (efficiency if dev == "cpu" else 1.0)
        lowp = fast_codec in ("int8", "fp8_e4m3")
        device_flops = (profile.device_lowp_tflops if lowp else profile.device_bf16_tflops) * 1e12
        host_bps, host_flops = profile.host_mem_gbps * 1e9 * efficiency, profile.cpu_gflops * 1e9
        expert_overhead = profile.expert_overhead_us * 1e-6
        if dev == "cuda":
            link_s = copy_s = profile.link_seconds(stored)
            decode_s = 0.0 if fast_codec == c else (stored + fast) / device_bps
        else:  # the "link" is the decode into tier 1: a view when the block is used as stored
            copy_s = expert_overhead + (stored + fast) / (profile.link_gbps * 1e9)  # read + write
            link_s = expert_overhead if moves_whole(c, dev) else copy_s
            decode_s = 0.0
        act = 2 * shape.hidden * ACTIVATION_DTYPE_BYTES
        n_moe = max(1, len(shape.moe_layers))
        # The engine keeps dense weights in its compute dtype: fp32 on a CPU, bf16 on a GPU.
        dense = codec_name(dense_codec) if dense_codec else ("fp32" if dev == "cpu" else "bf16")
        dense_bytes = shape.dense_bytes_per_token(dense) / n_moe
        dense_flops = shape.dense_flops_per_token() / n_moe
        engine = priced(shape, profile)  # the tiered provider's bookkeeping (TieredReplay only)
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
            expert_overhead_s=expert_overhead,
            layer_overhead_s=profile.layer_overhead_us * 1e-6 * max(shape.num_layers, n_moe) / n_moe,
            tier_overhead_s=engine.tier_us * 1e-6,
            miss_overhead_s=engine.miss_us * 1e-6,
            stream_overhead_s=engine.stream_us * 1e-6,
            copy_s=copy_s,
            host_codec_bps=_codec_gbps(profile, c) * 1e9,
            fast_codec_bps=_codec_gbps(profile, fast_codec) * 1e9 if dev == "cpu" else 0.0,
            link_bps=profile.link_gbps * 1e9,
            link_latency_s=profile.link_latency_us * 1e-6,
        )

    def fast_compute_s(self, tokens: int) -> float:
        read = self.fast_bytes / (self.fast_codec_bps or self.device_bps)
        return max(read, 2 * self.params * tokens / self.device_flops) + self.expert_overhead_s

    def host_compute_s(self, tokens: int) -> float:
        read = self.stored_bytes / (self.host_codec_bps or self.host_bps)
        return max(read, 2 * self.params * tokens / self.host_flops) + self.expert_overhead_s

    def promote_s(self, moves_up: bool) -> float:
        """Tier 2 -> tier 1 of a block that moves up (its bytes become tier 1's) or not (tier 1
        gets its own copy); on a GPU both cross the link (`link_s`)."""
        return self.link_s if moves_up or self.device == "cuda" else self.copy_s

    def rows_copy_s(self, nbytes: int) -> float:
        """CUDA: one copy of `nbytes` host -> device (a SPLIT's rows), its latency included."""
        return self.link_latency_s + nbytes / self.link_bps

    def dense_s(self, tokens: int) -> float:
        """One MoE layer's share of the dense part of a step of `tokens` tokens, its share of the
        layers' fixed overhead included."""
        weights = max(self.dense_layer_s, self.dense_layer_flops * tokens / self.device_flops)
        return weights + self.layer_overhead_s


def _codec_gbps(profile: HardwareProfile, codec: str) -> float:
    """The profile's measured CPU rate through `codec`'s weights (0: none, read at memory speed)."""
    return {"int8": profile.host_int8_gbps, "mxfp4": profile.host_mxfp4_gbps}.get(codec, 0.0)


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
