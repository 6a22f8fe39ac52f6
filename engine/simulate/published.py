"""Published decode runs of real MoE offloading systems, as simulator setups (issue 62).

Each `PublishedRun` names its source, the machine as a `HardwareProfile` (every figure with its
source or marked "estimate", in `PROFILES`), the model, its codec, how much of the experts the
system keeps in fast memory, the policy that system runs, and the decode tok/s it published.
`bench/simulate_published.py` replays each on a synthetic trace of its model and prints the
prediction beside the published figure.

Figures shared by several setups, set once (none is fitted to the setup it predicts):
- the CPU's share of DRAM bandwidth an expert GEMV reaches (`host_efficiency`): llama.cpp on
  desktops ~0.6, ktransformers on an 8-channel server ~0.4, PyTorch bf16 on a CPU without native
  bf16 ~0.2 (FACTS.md, "Published decode figures": ranges implied by several published runs);
- the fixed cost of a transformer layer on an NVIDIA GPU (`layer_overhead_us`, `nvidia_layer_us`):
  the layer's small kernels (norms, rope, router, top-k, the activations' quantization, the
  experts' sum) and the shortfall of its GEMVs from the memory's peak on small matrices, in one
  figure, scaled by the GPU's boost clock (with CUDA graphs the CPU is out of the loop and those
  kernels run at the SM clock). Set from one run that is not among the ones predicted:
  Qwen3-30B-A3B Q4_K with every expert on an RTX 3090 Ti (1008 GB/s, 1.86 GHz), 166.9 tok/s
  (`CALIBRATION`): 5.99 ms a token less its 1.84 GB read at 1008 GB/s, over 48 layers, is
  86.7 us at 1.86 GHz. (It was 35 us, FACTS.md's figure for the RTX 4090, which the model's own
  bytes do not give: the 4090's 196 tok/s leaves 68 us a layer at full bandwidth.) ~250 us on ROCm
  (FACTS.md, the same section: implied by all-on-GPU runs);
- the host <-> device hand-off of a layer whose experts run on the CPU: two copies of the hidden
  state at `link_latency_us` each (10 us: FACTS.md, the H200's launch and sync costs).

mixtral-offloading is replayed with its own cache (`peers.replay_swap_cache`: one expert a layer on
the GPU, each miss a swap whose two copies and the experts' compute share one CUDA stream), not
the engine's per-layer LRU ("layer-lru"), whose prefetch and copy-only misses it does not have.
"""

from __future__ import annotations

from dataclasses import dataclass

from .profiles import GiB, HardwareProfile

__all__ = ["CALIBRATION", "PEER_POLICIES", "PROFILES", "PUBLISHED_RUNS", "PublishedRun", "nvidia_layer_us"]

CALIBRATION = {
    "source": "smeltcore.com/recipes/qwen3-30b-a3b-rtx-3090-ti (Qwen3-30B-A3B Q4_K, -ngl 99)",
    "tok_s": 166.9,  # "166.9 tok/s generation at 4K context (Q4_K)"
    "device_mem_gbps": 1008.0,  # RTX 3090 Ti spec sheet: 384-bit GDDR6X at 21 Gbps
    "boost_ghz": 1.86,  # RTX 3090 Ti spec sheet
    "layers": 48,
}
"""The run the NVIDIA per-layer cost is set from (module docstring); a test derives
`NVIDIA_LAYER_US_GHZ` from it and the model's own bytes."""
NVIDIA_LAYER_US_GHZ = 86.7 * 1.86  # us x GHz: (1 / 166.9 - 1.844 GB / 1008 GB/s) / 48 at 1.86 GHz
ROCM_LAYER_US = 250.0  # FACTS.md: implied by all-on-GPU runs on ROCm
LLAMA_CPP_CPU = 0.6  # FACTS.md: llama.cpp's CPU expert kernels on desktops reach ~52-70% of DRAM
KTRANSFORMERS_CPU = 0.4  # FACTS.md: ktransformers on an 8-channel server ~35-45%
PYTORCH_BF16_CPU = 0.2  # FACTS.md: a PyTorch bf16 CPU path ~20% (compute bound)


def nvidia_layer_us(boost_ghz: float) -> float:
    """A transformer layer's fixed cost on an NVIDIA GPU of `boost_ghz` (module docstring)."""
    return NVIDIA_LAYER_US_GHZ / boost_ghz


PROFILES: dict[str, HardwareProfile] = {
    # ktransformers' DeepSeek-R1/V3 tutorial machine: one Xeon Gold 6454S socket and an RTX 4090D.
    "xeon6454s-rtx4090d": HardwareProfile(
        name="xeon6454s-rtx4090d",
        device="cuda",
        link_gbps=25.0,  # estimate: PCIe 4.0 x16, as rtx4090-pcie4
        link_latency_us=10.0,  # FACTS.md (H200): ~7.7 us a launch, ~11.7 us a sync
        device_mem_gbps=1008.0,  # RTX 4090D spec sheet: 384-bit GDDR6X at 21 Gbps
        device_mem_bytes=24 * GiB,
        device_bf16_tflops=147.0,  # estimate: the 4090's 165.2 x 14,592 / 16,384 CUDA cores
        device_lowp_tflops=294.0,
        host_mem_gbps=307.2,  # Intel ARK, Xeon Gold 6454S: 8 channels of DDR5-4800 (8 x 38.4 GB/s)
        host_mem_bytes=1024 * GiB,  # the tutorial's 1 TB of DRAM
        disk_gbps=5.0,  # estimate, as rtx4090-pcie4
        cpu_gflops=1800.0,  # estimate: 32 cores x 2.2 GHz x 64 fp32 FLOP/cycle (AVX-512), ~40%
        cpu_cores=32,  # Intel ARK
        layer_overhead_us=nvidia_layer_us(2.52),  # RTX 4090D spec sheet: 2.52 GHz boost
        host_efficiency=KTRANSFORMERS_CPU,
    ),
    # Fiddler's README machine: a Quadro RTX 6000 (PCIe 3) and a 48-core Skylake (two sockets).
    "quadro-rtx6000-skylake": HardwareProfile(
        name="quadro-rtx6000-skylake",
        device="cuda",
        link_gbps=12.5,  # estimate: PCIe 3.0 x16 is 15.75 GB/s raw, ~0.8 of it pinned
        link_latency_us=10.0,
        device_mem_gbps=672.0,  # Quadro RTX 6000 spec sheet: 384-bit GDDR6 at 14 Gbps
        device_mem_bytes=24 * GiB,
        device_bf16_tflops=130.5,  # spec sheet: FP16 tensor (Turing has no bf16; the stand-in)
        device_lowp_tflops=261.0,  # spec sheet: INT8 tensor
        host_mem_gbps=256.0,  # estimate: 2 x 6 channels of DDR4-2666 (Skylake-SP), 21.3 GB/s each
        host_mem_bytes=384 * GiB,  # estimate
        disk_gbps=3.0,  # estimate
        cpu_gflops=2500.0,  # estimate: 48 cores x 2.1 GHz x 64 FLOP/cycle, ~40%
        cpu_cores=48,
        layer_overhead_us=nvidia_layer_us(1.77),  # Quadro RTX 6000 spec sheet: 1.77 GHz
        host_efficiency=PYTORCH_BF16_CPU,
    ),
    # The fiddler repository's RTX A6000 benchmark machine (PCIe 4).
    "rtx-a6000-pcie4": HardwareProfile(
        name="rtx-a6000-pcie4",
        device="cuda",
        link_gbps=25.0,  # estimate: PCIe 4.0 x16, as rtx4090-pcie4
        link_latency_us=10.0,
        device_mem_gbps=768.0,  # RTX A6000 spec sheet: 384-bit GDDR6 at 16 Gbps
        device_mem_bytes=48 * GiB,
        device_bf16_tflops=154.8,  # spec sheet: 309.7 TFLOPS with sparsity
        device_lowp_tflops=309.7,
        host_mem_gbps=100.0,  # estimate: a workstation's 4-channel DDR4
        host_mem_bytes=256 * GiB,  # estimate
        disk_gbps=3.0,  # estimate
        cpu_gflops=1000.0,  # estimate
        cpu_cores=16,  # estimate
        layer_overhead_us=nvidia_layer_us(1.80),  # RTX A6000 spec sheet: 1.80 GHz boost
        host_efficiency=PYTORCH_BF16_CPU,
    ),
    # llama.cpp discussion 15396: an RX 7900 XT and a Ryzen 9 5900X with dual-channel DDR4-3200.
    "rx7900xt-5900x": HardwareProfile(
        name="rx7900xt-5900x",
        device="cuda",  # a GPU behind a host link (ROCm or Vulkan): the model is the same
        link_gbps=25.0,  # estimate: PCIe 4.0 x16
        link_latency_us=10.0,
        device_mem_gbps=800.0,  # AMD spec sheet: 320-bit GDDR6 at 20 Gbps
        device_mem_bytes=20 * GiB,
        device_bf16_tflops=103.0,  # AMD spec sheet: FP16 matrix
        device_lowp_tflops=206.0,  # estimate: INT8 at twice FP16
        host_mem_gbps=51.2,  # dual-channel DDR4-3200: 2 x 25.6 GB/s
        host_mem_bytes=64 * GiB,  # estimate
        disk_gbps=5.0,  # estimate
        cpu_gflops=570.0,  # estimate: 12 Zen 3 cores x 3.7 GHz x 32 FLOP/cycle (AVX2), ~40%
        cpu_cores=12,
        layer_overhead_us=ROCM_LAYER_US,
        host_efficiency=LLAMA_CPP_CPU,
    ),
    # A desktop RTX 4090 with every expert on the card (public Qwen3-30B-A3B guides).
    "rtx4090-llamacpp": HardwareProfile(
        name="rtx4090-llamacpp",
        device="cuda",
        link_gbps=25.0,  # estimate, as rtx4090-pcie4
        link_latency_us=10.0,
        device_mem_gbps=1008.0,  # spec sheet
        device_mem_bytes=24 * GiB,
        device_bf16_tflops=165.2,  # Ada whitepaper
        device_lowp_tflops=330.3,
        host_mem_gbps=70.0,  # estimate, as rtx4090-pcie4
        host_mem_bytes=64 * GiB,
        disk_gbps=5.0,
        cpu_gflops=1000.0,
        cpu_cores=16,
        layer_overhead_us=nvidia_layer_us(2.52),  # RTX 4090 spec sheet: 2.52 GHz boost
        host_efficiency=LLAMA_CPP_CPU,
    ),
    # A desktop RTX 3090 with every expert on the card (Ollama's Qwen3-30B-A3B benchmark).
    "rtx3090-ollama": HardwareProfile(
        name="rtx3090-ollama",
        device="cuda",
        link_gbps=25.0,  # estimate, as rtx4090-pcie4
        link_latency_us=10.0,
        device_mem_gbps=936.0,  # RTX 3090 spec sheet: 384-bit GDDR6X at 19.5 Gbps
        device_mem_bytes=24 * GiB,
        device_bf16_tflops=71.0,  # Ampere GA102 whitepaper: FP16 tensor, FP32 accumulate, dense
        device_lowp_tflops=284.0,  # the same: INT8 tensor, dense
        host_mem_gbps=40.0,  # estimate: dual-channel DDR4
        host_mem_bytes=64 * GiB,  # estimate
        disk_gbps=3.0,  # estimate
        cpu_gflops=500.0,  # estimate
        cpu_cores=8,  # estimate
        layer_overhead_us=nvidia_layer_us(1.70),  # RTX 3090 spec sheet: 1.70 GHz boost
        host_efficiency=LLAMA_CPP_CPU,
    ),
}
"""The published setups' machines, by name."""


@dataclass(frozen=True)
class PublishedRun:
    """One published decode figure and the setup that gave it."""

    name: str
    source: str
    model: str  # a built-in shape (`shapes.shape_for`)
    profile: str  # a key of `PROFILES`
    codec: str  # the routed experts' codec
    dense_codec: str  # what the dense weights are held in
    policy: str  # the simulator policy that system runs, or one of `PEER_POLICIES`
    fast_experts: int | None  # routed experts kept in fast memory (None: all of them)
    published: float  # decode tok/s
    at_least: bool = False  # published as "> figure"
    context: int = 1024  # tokens of KV the device holds (the published runs' prompts are short)

    def fast_bytes(self, expert_bytes: int, total_experts: int) -> int:
        n = total_experts if self.fast_experts is None else self.fast_experts
        return n * expert_bytes


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    PublishedRun(
        name="ktransformers V0.2, DeepSeek-V3 Q4_K_M, routed experts on the CPU",
        source="kvcache-ai/ktransformers doc/en/DeepseekR1_V3_tutorial.md",
        model="deepseek-v3",
        profile="xeon6454s-rtx4090d",
        codec="q4_k_m",
        dense_codec="q4_k_m",
        policy="static-layers",
        fast_experts=0,
        published=8.73,
    ),
    PublishedRun(
        name="Fiddler, Mixtral-8x7B bf16, ~56 experts on the GPU",
        source="efeslab/fiddler README",
        model="mixtral-8x7b",
        profile="quadro-rtx6000-skylake",
        codec="bf16",
        dense_codec="bf16",
        policy="static",
        fast_experts=56,
        published=3.0,
        at_least=True,
    ),
    PublishedRun(
        # efeslab/fiddler benchmarks/eval-baseline.py ran it unquantized (`quantized = False`, so no
        # HQQ codec: the experts stay 16-bit, `model.bfloat16()`) with `offload_per_layer = 7` of 8:
        # `main_size` = 32 layers x 1 expert on the GPU. Its log: "input_token: 32, output_token:
        # 64, ... time: 102.37, output token/s: 0.63"; the time includes the 32-token prefill, which
        # this decode-only prediction leaves out (~6% of it by the same replay's per-miss cost).
        name="mixtral-offloading, Mixtral-8x7B bf16, one expert a layer on the GPU",
        source="efeslab/fiddler benchmarks/results/RTX-A6000/mixtral-offload-ShareGPT-A6000-Oct-16.log",
        model="mixtral-8x7b",
        profile="rtx-a6000-pcie4",
        codec="bf16",
        dense_codec="bf16",
        policy="mixtral-offloading",
        fast_experts=32,  # 1 of 8 in each of 32 layers
        published=0.63,
    ),
    PublishedRun(
        name="llama.cpp -cmoe, gpt-oss-20b, every expert on the CPU",
        source="ggml-org/llama.cpp discussion 15396",
        model="gpt-oss-20b",
        profile="rx7900xt-5900x",
        codec="mxfp4",
        dense_codec="bf16",
        policy="static-layers",
        fast_experts=0,
        published=20.0,
    ),
    PublishedRun(
        name="llama.cpp, Qwen3-30B-A3B Q4_K_M, every expert on the GPU",
        # "an RTX 4090 running Qwen3-30B-A3B at up to 196 tokens per second" (Q4, the whole model
        # in VRAM; a llama.cpp-based runner).
        source="runaihome.com/blog/qwen3-30b-a3b-local-ai-guide-2026",
        model="qwen3-30b-a3b",
        profile="rtx4090-llamacpp",
        codec="q4_k_m",
        dense_codec="q4_k_m",
        policy="static",
        fast_experts=None,
        published=196.0,
    ),
    PublishedRun(
        # Not one of issue 62's five: a check of the per-layer cost out of the run it was set from
        # (the same model on an RTX 3090 Ti), on another card. "Qwen3 30B ... 141.9 / 140.9 / 141.5
        # t/s" over three prompts, 128 tokens each, Ollama 0.21.0, every weight in VRAM.
        name="Ollama, Qwen3-30B-A3B Q4_K_M, every expert on an RTX 3090",
        source="multimodalflow.net/en/blog/qwen3-30b-vs-gemma4-26b-rtx3090",
        model="qwen3-30b-a3b",
        profile="rtx3090-ollama",
        codec="q4_k_m",
        dense_codec="q4_k_m",
        policy="static",
        fast_experts=None,
        published=141.0,
    ),
)
"""Issue 62's five published runs, and a sixth that checks the per-layer cost on another card."""

PEER_POLICIES = ("mixtral-offloading",)
"""Policies of `PublishedRun` that are other systems' own caches (`peers`), not `simulate`'s."""


def published_trace(model: str, tokens: int, seed: int = 0) -> list:
    """A synthetic decode trace of `model` (`synthetic`'s calibrated presets for Mixtral-8x7B and
    Qwen3-30B-A3B; others with Qwen3's assumptions: Mixtral's stickiness on their own chance,
    Zipf 0.5), its layers numbered as the model's MoE layers."""
    from ..memory.routing_trace import RoutingRecord
    from .shapes import shape_for
    from .synthetic import MIXTRAL_8X7B, QWEN3_30B_A3B, preset_trace, synthetic_trace

    shape = shape_for(model)
    if model == "mixtral-8x7b":
        records = preset_trace(MIXTRAL_8X7B, tokens=tokens, seed=seed)
    elif model == "qwen3-30b-a3b":
        records = preset_trace(QWEN3_30B_A3B, tokens=tokens, seed=seed)
    else:
        chance = shape.top_k / shape.num_experts
        records = synthetic_trace(
            layers=len(shape.moe_layers),
            num_experts=shape.num_experts,
            top_k=shape.top_k,
            tokens=tokens,
            reuse=chance + (1 - chance) / 6,
            skew=QWEN3_30B_A3B.skew,
            cross_layer=0.0,
            seed=seed,
        )
    layers = shape.moe_layers
    return [RoutingRecord(r.seq, r.token, layers[r.layer], r.experts, r.weights, r.phase) for r in records]


def predict(run: PublishedRun, tokens: int = 64, seed: int = 0) -> float:
    """The simulator's decode tok/s for `run` on a synthetic trace of `tokens` tokens."""
    from ..memory.routing_trace import group_steps
    from .fit import check_fits
    from .machine import ExpertCosts, tier1_codec
    from .peers import replay_swap_cache
    from .shapes import shape_for
    from .simulator import simulate

    shape, profile = shape_for(run.model), PROFILES[run.profile]
    per_expert = shape.expert_bytes(tier1_codec(run.codec, profile.device))
    total = len(shape.moe_layers) * shape.num_experts
    fast_bytes = run.fast_bytes(per_expert, total)
    trace = published_trace(run.model, tokens, seed)
    if run.policy in PEER_POLICIES:
        check_fits(
            shape,
            profile,
            fast_bytes=fast_bytes,
            host_bytes=None,
            dense_codec=run.dense_codec,
            context=run.context,
        )
        costs = ExpertCosts.of(shape, profile, run.codec, dense_codec=run.dense_codec)
        slots = fast_bytes // per_expert // len(shape.moe_layers)
        tally = replay_swap_cache(
            group_steps(trace), shape.moe_layers, costs, num_experts=shape.num_experts, slots=slots
        )
        return tally.tokens / tally.seconds
    report = simulate(
        trace,
        shape,
        profile,
        fast_bytes=fast_bytes,
        codec=run.codec,
        dense_codec=run.dense_codec,
        policies=(run.policy,),
        context=run.context,
        seed=seed,
    )
    result = report.result(run.policy)
    if result.tokens_per_s is None:
        raise ValueError(f"{run.name}: {result.infeasible}")
    return result.tokens_per_s
