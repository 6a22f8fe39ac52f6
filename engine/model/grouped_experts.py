"""Routed experts as stacked weights computed by one grouped GEMM per projection.

An `ExpertStack` holds experts of one shape stacked along a slot dimension: `gate_up [S, 2I, H]`,
`down [S, H, I]` and optional biases `[S, 2I]` / `[S, H]`. A layer's MoE step sorts its (token,
expert) pairs by slot and runs `torch._grouped_mm` once for gate_up and once for down over all
of them: no Python call chain per expert, and no host sync (the group offsets are computed on
the device), so it is CUDA-graph capturable. The resident provider stacks each layer's experts
(slot = expert id); tier 1 on a GPU is a slot pool of this form with a device-side expert -> slot
table (`slots.py`).

Arithmetic is that of `routed.expert_forward` + `routed.dispatch_experts`: on CPU
`_grouped_mm` runs the same matmul per group as `F.linear` per expert (bit for bit, checked in
tests/test_grouped_experts.py), biases are added after the product as in the reference, and
each token's weighted expert outputs are accumulated in ascending expert order by one
`index_add_`. So a resident engine and a tiered one give identical logits.

On CPU (torch 2.13) `_grouped_mm` is a loop of ATen calls, ~3 us per empty group and ~19 us per
non-empty one on a 2-core AVX2 VM (bench: tests' tiny models, torch profiler), so a decode step
(A routed experts out of E) runs faster as the loop over the routed experts' views of the stack
in `routed.dispatch_experts`; prefill (many tokens per expert) uses the grouped GEMM there too.

A stack may hold int8 or MXFP4 experts too (both projections in one codec, with their scales:
`codec`): `run_grouped` then runs the grouped Triton GEMVs of `gemv_triton` (route = a (token,
expert) pair, its slot read on the device), which serve decode steps on a GPU and are
capturable like the float grouped GEMM; on a CPU only Triton's interpreter runs them (tests).

This module holds the kernels (`run_grouped`, `run_pair`); which one computes a routed batch, or
the per-expert loop, is chosen in one place: `routed.run_routed` (with `routed.use_grouped`).

Letters: T tokens, A active experts per token, S slots (stacked experts), H hidden, I expert
intermediate size.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch
import torch.nn.functional as F

from ..ftw.codecs import get_codec
from ..kernels import gemv_triton
from ..kernels.int8 import quantize
from ..kernels.mxfp4 import decode_weight
from ..spec import MoESpec

logger = logging.getLogger(__name__)

_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}


StackCodec = Literal["float", "int8", "mxfp4"]
"""How a stack holds its projections: float, int8 with fp32 row scales, or MXFP4 blocks with E8M0
scales (`experts.ExpertWeights`' compact forms)."""

_NAMES = ("gate_up", "down", "gate_up_bias", "down_bias", "gate_up_scale", "down_scale")

GEMV_MAX_TOKENS = 8
"""Most tokens a compact stack's grouped GEMVs serve (a decode step), as `int8_linear` and
`mxfp4_linear` take their GEMV kernels up to 8 tokens."""


@dataclass(frozen=True)
class ExpertStack:
    """Experts of one shape stacked along dim 0 (a slot per expert)."""

    gate_up: torch.Tensor  # [S, 2I, H] (int8; MXFP4 blocks [S, 2I, H/2])
    down: torch.Tensor  # [S, H, I] (int8; MXFP4 blocks [S, H, I/2])
    gate_up_bias: torch.Tensor | None = None  # [S, 2I]
    down_bias: torch.Tensor | None = None  # [S, H]
    gate_up_scale: torch.Tensor | None = None  # int8: [S, 2I] fp32; MXFP4: [S, 2I, H/32] uint8
    down_scale: torch.Tensor | None = None  # int8: [S, H] fp32; MXFP4: [S, H, I/32] uint8

    @classmethod
    def stack(cls, experts: Sequence[dict[str, torch.Tensor]]) -> ExpertStack:
        """Stack per-expert tensors (names of `ExpertWeights.tensors`; same shapes, dtype and
        device; one `stack_codec`) into fresh contiguous buffers.

        The canonical [out, in] layout of every other provider is kept, although MKL's GEMV reads
        [in, out] ~1.4x faster (dense weights take that layout, `MoETransformer.
        prepare_decode_layout`): experts computed in the same layout give the same bits as the
        FTW and tiered providers (measured cost: ~9% of a decode token on bench/decode.py's
        quick model, 1 thread)."""
        out = {}
        for name in _NAMES:
            if experts[0].get(name) is not None:
                out[name] = torch.stack([e[name] for e in experts])
        return cls(**out)

    @property
    def slots(self) -> int:
        return self.gate_up.shape[0]

    @cached_property
    def codec(self) -> StackCodec:
        codec = stack_codec(self.tensors(0))
        assert codec is not None
        return codec

    def tensors(self, slot: int) -> dict[str, torch.Tensor]:
        """Views of one slot's tensors (the per-expert names of `ExpertWeights`)."""
        return {n: t[slot] for n in _NAMES if (t := getattr(self, n)) is not None}


def stack_codec(tensors: Mapping[str, torch.Tensor]) -> StackCodec | None:
    """The codec of the stack an expert's tensors (`ExpertWeights.tensors`) can join: both
    projections float with no scales, both int8, or both MXFP4; None for a mixed expert (it is
    computed projection by projection, outside stacks)."""
    gate_up, down = tensors["gate_up"], tensors["down"]
    scaled = [tensors.get(n) is not None for n in ("gate_up_scale", "down_scale")]
    if not any(scaled):
        return "float" if gate_up.is_floating_point() and down.dtype == gate_up.dtype else None
    if not all(scaled) or gate_up.dtype != down.dtype:
        return None
    return {torch.int8: "int8", torch.uint8: "mxfp4"}.get(gate_up.dtype)  # type: ignore[return-value]


def activation(gate_up: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """[.., 2I] (gate columns first) -> [.., I]: SwiGLU, or gpt-oss's clamped variant."""
    gate, up = gate_up.chunk(2, dim=-1)
    if spec.activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=spec.swiglu_limit)
    up = up.clamp(-spec.swiglu_limit, spec.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * spec.swiglu_alpha))


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs here for `dtype` and equals per-group matmuls (checked
    once per device type and dtype; CUDA builds take bf16 on recent GPUs only)."""
    key = (device.type, dtype)
    if key not in _GROUPED_OK:
        _GROUPED_OK[key] = _self_check(device, dtype)
    return _GROUPED_OK[key]


_CAPTURABLE: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_capturable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` for `dtype` can be captured in a CUDA graph (checked once by
    capturing it). On the H200 with torch 2.11 bf16 can, fp32 cannot: its fallback copies the
    group offsets to the host ("Cannot copy between CPU and CUDA tensors during CUDA graph
    capture"). Off CUDA: False."""
    if device.type != "cuda" or not grouped_mm_available(device, dtype):
        return False
    key = (str(device), dtype)
    if key not in _CAPTURABLE:
        w = torch.zeros(3, 32, 16, device=device, dtype=dtype)
        x = torch.zeros(4, 16, device=device, dtype=dtype)
        offs = torch.tensor([1, 1, 4], dtype=torch.int32, device=device)
        torch._grouped_mm(x, w.transpose(1, 2), offs=offs)  # warm-up outside the capture
        torch.cuda.synchronize(device)
        try:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
            _CAPTURABLE[key] = True
        except RuntimeError as e:
            logger.info("torch._grouped_mm for %s cannot be captured in a CUDA graph (%s)", dtype, e)
            _CAPTURABLE[key] = False
    return _CAPTURABLE[key]


def _self_check(device: torch.device, dtype: torch.dtype) -> bool:
    op = getattr(torch, "_grouped_mm", None)
    if op is None:
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 32, 16, generator=g).to(device=device, dtype=dtype)  # [S, N, K]
    x = torch.randn(4, 16, generator=g).to(device=device, dtype=dtype)
    offs = torch.tensor([1, 1, 4], dtype=torch.int32, device=device)  # an empty group in the middle
    try:
        got = op(x, w.transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        logger.info("torch._grouped_mm unavailable for %s on %s (%s)", dtype, device.type, e)
        return False
    want = torch.cat([x[:1] @ w[0].T, x[1:] @ w[2].T])
    ok = bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))
    if not ok:
        logger.warning("torch._grouped_mm gives wrong values for %s on %s; not using it", dtype, device.type)
    return ok


def run_grouped(
    stack: ExpertStack,
    hidden: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    spec: MoESpec,
) -> torch.Tensor:
    """hidden [T, H], slot_ids [T, A] (int64 slots of `stack`), weights [T, A] -> [T, H]: the sum
    over each token's experts of `weight * expert(x)`, accumulated in ascending slot order.

    Every op runs on the device: no host sync, static shapes for a given T (CUDA-graph safe).
    A compact stack (int8 / MXFP4) runs its grouped GEMVs (`run_grouped_gemv`).
    """
    if stack.gate_up_scale is not None:
        return run_grouped_gemv(stack, hidden, slot_ids, weights, spec)
    t, a = slot_ids.shape
    flat = slot_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [T*A] pairs by slot (then token)
    token_of = torch.div(order, a, rounding_mode="floor")
    sorted_slots = flat.index_select(0, order)
    # [S] end of each slot's group; searchsorted, not bincount, whose output size needs a sync.
    slot_ids = torch.arange(stack.slots, device=flat.device)
    offs = torch.searchsorted(sorted_slots, slot_ids, right=True).to(torch.int32)
    x = hidden.index_select(0, token_of)  # [T*A, H]
    gate_up = torch._grouped_mm(x, stack.gate_up.transpose(1, 2), offs=offs)  # [T*A, 2I]
    if stack.gate_up_bias is not None:
        gate_up = gate_up + stack.gate_up_bias.index_select(0, sorted_slots)
    y = torch._grouped_mm(activation(gate_up, spec), stack.down.transpose(1, 2), offs=offs)  # [T*A, H]
    if stack.down_bias is not None:
        y = y + stack.down_bias.index_select(0, sorted_slots)
    y = y * weights.reshape(-1).index_select(0, order)[:, None]
    out = torch.zeros_like(hidden)
    return out.index_add_(0, token_of, y.to(out.dtype))


def run_grouped_gemv(
    stack: ExpertStack,
    hidden: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    spec: MoESpec,
) -> torch.Tensor:
    """`run_grouped` for a compact stack (int8 or MXFP4): hidden [T, H] (T a decode step's few
    tokens), slot_ids [T, A], weights [T, A] -> [T, H]. Each (token, expert) pair is a route of
    the grouped GEMVs, its slot read on the device; each projection's arithmetic is that of
    `int8_linear` / `mxfp4_linear` on a GPU (fp32 accumulation, the bias added in fp32, then
    the activation dtype), and each token's weighted outputs are summed in ascending slot order.
    No host sync (CUDA-graph safe)."""
    t, a = slot_ids.shape
    routes = slot_ids.reshape(-1)  # [T*A], token-major: route r is token r // A
    gate_up = _project_routes(hidden, stack.gate_up, stack.gate_up_scale, stack.gate_up_bias, routes, a)
    y = _project_routes(activation(gate_up, spec), stack.down, stack.down_scale, stack.down_bias, routes, 1)
    order = slot_ids.argsort(dim=1, stable=True)  # [T, A]
    y = y.view(t, a, -1).gather(1, order[..., None].expand(t, a, y.shape[-1]))  # [T, A, H]
    w = weights.gather(1, order).to(y.dtype)
    out = y[:, 0] * w[:, :1]
    for j in range(1, a):
        out = out + y[:, j] * w[:, j : j + 1]
    return out.to(hidden.dtype)


def _project_routes(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    routes: torch.Tensor,
    x_div: int,
) -> torch.Tensor:
    """Route r: x[r // x_div] @ W[routes[r]].T (+ its bias) -> [R, N] in x.dtype."""
    assert scale is not None
    if weight.dtype == torch.uint8:
        y = gemv_triton.mxfp4_grouped_gemv(x, weight, scale, routes, x_div)
    else:
        y = gemv_triton.int8_grouped_gemv(x, weight, scale, routes, x_div)
    if bias is not None:
        y = y + bias.index_select(0, routes)
    return y.to(x.dtype)


def grouped_gemv_ok(device: torch.device, codec: StackCodec) -> bool:
    """Whether a compact stack's grouped GEMVs serve decode on `device`: a GPU where Triton runs
    them and they agree with the per-expert path (checked once per device and codec; a failure
    is logged and the per-expert loop serves)."""
    if codec == "float" or device.type != "cuda":
        return False
    return gemv_triton.usable(f"grouped {codec}", device, lambda d: _gemv_self_check(d, codec))


def _gemv_self_check(device: torch.device, codec: StackCodec) -> bool:
    """Three random experts in `codec`, two tokens routed to two each: the grouped GEMVs against
    the dequantized weights' float matmuls."""
    g = torch.Generator().manual_seed(0)
    spec = MoESpec(num_experts=3, top_k=2, intermediate_size=64, routing="softmax_topk")
    parts: dict[str, list[torch.Tensor]] = {}
    floats: dict[str, list[torch.Tensor]] = {"gate_up": [], "down": []}
    for _ in range(3):
        for name, shape in (("gate_up", (128, 96)), ("down", (96, 64))):
            weight, scale, dequantized = compact_weight(torch.randn(*shape, generator=g), codec)
            parts.setdefault(name, []).append(weight)
            parts.setdefault(f"{name}_scale", []).append(scale)
            floats[name].append(dequantized.to(device))
    stack = ExpertStack(**{n: torch.stack(ts).to(device) for n, ts in parts.items()})
    x = torch.randn(2, 96, generator=g).to(device)
    ids = torch.tensor([[2, 0], [1, 2]], device=device)
    weights = torch.rand(2, 2, generator=g).to(device)
    want = torch.zeros_like(x)
    for t in range(2):
        for a in range(2):
            e = int(ids[t, a])
            h = activation(F.linear(x[t : t + 1], floats["gate_up"][e]), spec)
            want[t] += weights[t, a] * F.linear(h, floats["down"][e])[0]
    got = run_grouped_gemv(stack, x, ids, weights, spec)
    return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())))


def compact_weight(w: torch.Tensor, codec: StackCodec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float weight [N, K] in `codec` ("int8" or "mxfp4") -> (weight, scale, its fp32 values):
    int8 [N, K] with fp32 row scales [N], or MXFP4 blocks [N, K/2] with E8M0 scales [N, K/32]
    (`experts.ExpertWeights`' compact forms)."""
    if codec == "int8":
        q, scale = quantize(w)
        return q, scale, q.float() * scale[:, None]
    enc = get_codec("mxfp4").encode(w)
    blocks, scales = enc.parts["blocks"].reshape(w.shape[0], w.shape[1] // 2), enc.parts["scales"]
    return blocks, scales, decode_weight(blocks, scales, torch.float32)


def stack_capturable(codec: StackCodec, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a stack of `codec` computed for activations of `dtype` can run in a captured
    CUDA graph: the float grouped GEMM where it captures (`grouped_mm_capturable`), the compact
    grouped GEMVs where they serve (Triton kernels capture once compiled: the capture's warm-up
    compiles them)."""
    if codec == "float":
        return grouped_mm_capturable(device, dtype)
    return grouped_gemv_ok(device, codec)


def run_pair(
    stack: ExpertStack,
    hidden: torch.Tensor,
    expert_ids: list[int],
    weights: torch.Tensor,
    spec: MoESpec,
    keys: list[int] | None = None,
) -> torch.Tensor:
    """One token routed to two experts (top-2, CPU decode) as batched GEMVs instead of a loop.

    Two slots e0 < e1 of a stack are always one strided view (`stack[e0::e1 - e0][:2]`), so both
    experts run as one batched GEMV per projection, no copy of the weights. The same bits as
    the expert-by-expert loop of `routed.dispatch_experts` (bmm of a row equals F.linear here,
    checked in tests/test_grouped_experts.py; the weighted outputs are added in ascending id with
    the loop's add_(alpha=)). hidden [1, H], expert_ids the two slots (host ints), weights [1, 2]
    in the same order -> [1, H]. `keys`: the two experts' ids when the slots are not them (tier 1's
    slot pool), which set the order the outputs are added in (with a fused multiply-add the order
    changes the bits); by default the slots.
    """
    ws = weights.tolist()[0]
    e0, e1 = expert_ids
    order = list(expert_ids if keys is None else keys)
    if e1 < e0:
        e0, e1 = e1, e0
        ws.reverse()
        order.reverse()
    pick = slice(e0, e1 + 1, e1 - e0)
    x = hidden.expand(2, *hidden.shape)  # [2, 1, H]
    gate_up = torch.bmm(x, stack.gate_up[pick].transpose(1, 2))  # [2, 1, 2I]
    if stack.gate_up_bias is not None:
        gate_up = gate_up + stack.gate_up_bias[pick][:, None]
    # The activation row by row: on a [2, 1, 2I] tensor the vectorised sigmoid of gpt-oss's clamped
    # SwiGLU rounds differently from the loop's [1, 2I] in ~40% of elements; per row, the same bits.
    act = torch.stack([activation(gate_up[0], spec), activation(gate_up[1], spec)])  # [2, 1, I]
    y = torch.bmm(act, stack.down[pick].transpose(1, 2))  # [2, 1, H]
    if stack.down_bias is not None:
        y = y + stack.down_bias[pick][:, None]
    first = 0 if order[0] < order[1] else 1
    acc = torch.zeros_like(hidden)
    acc.add_(y[first], alpha=ws[first])
    return acc.add_(y[1 - first], alpha=ws[1 - first])
