"""How a routed batch is computed: the one place that chooses among the grouped GEMM, the top-2
pair and the per-expert loop, and dispatches to it.

`run_routed(hidden [T, H], expert_ids [T, A], weights [T, A], spec, ...) -> [T, H]` is the sum over
each token's selected experts of `weight * expert(x)`. Every store computes its routed batches
through it: the resident store (`experts.InMemoryExpertProvider`, with its layer's `ExpertStack`),
the FTW store (`loading.ftw_provider.FTWExpertProvider`, expert weights read on first use) and the
tiered store (`memory.provider.TieredExpertProvider`: its all-resident decode step, and its step
that decides per expert where to compute). The caller gives what it has:

- `stack`: the layer's stacked experts (slot = expert id), if it has them;
- `get`: expert id -> its weights (computed by `expert_forward`), or
- `compute`: expert id, its tokens' hidden -> their outputs, for a store that decides per expert
  where and how it computes (the tiered one).

The choice (the first that applies):

1. grouped GEMM (`grouped_experts.run_grouped`): a stack, and `use_grouped` (`torch._grouped_mm`
   works for its device and dtype, and this is not a CPU decode step, where a loop over the A routed
   experts is faster: see `grouped_experts`' module doc); for an int8 or MXFP4 stack, its grouped
   GEMVs on a GPU for a decode step;
2. top-2 pair (`grouped_experts.run_pair`): a float stack, one token routed to two distinct
   experts (both as one strided view of the stack, one batched GEMV per projection);
3. the per-expert loop (`dispatch_experts`): everything else.

All three give the same bits and accumulate each token's weighted outputs in ascending expert id
(the reference's summation order), which is what makes the stores' logits agree with each other
and with transformers.

Not chosen here: in the per-expert loop, int8 and MXFP4 projections pick a fused GEMV kernel
(decode) or dequantize + GEMM (prefill) inside `int8.int8_linear` / `mxfp4.mxfp4_linear`. That
is a per-linear choice (by the row count and the device of one matmul), shared with the dense
int8 layers (`int8.Int8Linear`, attention and lm_head) that are no routed batch, so it stays
with those kernels; here an expert's projections just call them (`expert_forward`). A compact
stack's decode step on a GPU runs the grouped form of the same kernels (choice 1).

Letters: T tokens, H hidden, I expert intermediate size, A active experts per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from ..kernels.int8 import int8_linear
from ..kernels.mxfp4 import mxfp4_linear
from ..spec import MoESpec
from .grouped_experts import (
    GEMV_MAX_TOKENS,
    ExpertStack,
    activation,
    grouped_gemv_ok,
    grouped_mm_available,
    run_grouped,
    run_pair,
)


class ExpertProjections(Protocol):
    """What `expert_forward` reads of one expert (`experts.ExpertWeights` is one)."""

    @property
    def gate_up(self) -> torch.Tensor: ...  # [2I, H] (int8, or MXFP4 blocks [2I, H/2])
    @property
    def down(self) -> torch.Tensor: ...  # [H, I]
    @property
    def gate_up_bias(self) -> torch.Tensor | None: ...
    @property
    def down_bias(self) -> torch.Tensor | None: ...
    @property
    def gate_up_scale(self) -> torch.Tensor | None: ...
    @property
    def down_scale(self) -> torch.Tensor | None: ...


def use_grouped(stack: ExpertStack, tokens: int) -> bool:
    """Whether `run_grouped` should compute this step (else a loop over the routed experts): a
    float stack everywhere `_grouped_mm` works, except a CPU decode step (see `grouped_experts`'
    module doc); a compact (int8 / MXFP4) stack for a decode step where its grouped GEMVs serve
    (a GPU: `grouped_gemv_ok`)."""
    w = stack.gate_up
    if stack.gate_up_scale is not None:
        return (
            tokens <= GEMV_MAX_TOKENS and w.device.type == "cuda" and grouped_gemv_ok(w.device, stack.codec)
        )
    return grouped_mm_available(w.device, w.dtype) and not (w.device.type == "cpu" and tokens == 1)


def run_routed(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    spec: MoESpec,
    *,
    stack: ExpertStack | None = None,
    get: Callable[[int], ExpertProjections] | None = None,
    compute: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """hidden [T, H], expert_ids [T, A] (int64), weights [T, A] -> [T, H]: the weighted sum of each
    token's selected experts, by the grouped GEMM, the top-2 pair or the per-expert loop (module
    doc). `stack` (slot = expert id) enables the first two; the loop computes expert `e` as
    `compute(e, x)`, or `expert_forward(get(e), x)`: exactly one of `get` / `compute`."""
    if (get is None) == (compute is None):
        raise ValueError("run_routed: give exactly one of get= and compute=")
    if stack is not None:
        if use_grouped(stack, hidden.shape[0]):
            return run_grouped(stack, hidden, expert_ids, weights, spec)
        if expert_ids.shape == (1, 2) and stack.gate_up_scale is None:  # CPU decode, top-2, float
            ids = expert_ids.tolist()[0]
            if ids[0] != ids[1]:
                return run_pair(stack, hidden, ids, weights, spec)
    if compute is None:
        assert get is not None
        compute = lambda e, x: expert_forward(get(e), x, spec)  # noqa: E731
    return dispatch_experts(compute, hidden, expert_ids, weights)


def run_experts(
    get: Callable[[int, int], ExpertProjections],
    layer: int,
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    spec: MoESpec,
) -> torch.Tensor:
    """`run_routed` of `layer`'s experts, `get(layer, expert)`, with no stack (the per-expert loop)."""
    return run_routed(
        hidden, expert_ids, weights, spec, compute=lambda e, x: expert_forward(get(layer, e), x, spec)
    )


def dispatch_experts(
    forward: Callable[[int, torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """hidden [T, H], expert_ids [T, A], weights [T, A] -> [T, H]: the sum over a token's experts
    of `weight * forward(expert, its tokens' hidden)`, experts in ascending id.

    Ascending order with index_add matches the reference summation order, so every provider that
    dispatches through here (in RAM, FTW, tiered) gives the same logits.
    """
    if hidden.shape[0] == 1:
        # Decode: one token, A experts; skip the grouping machinery (and per-expert tensor
        # indexing: ids and weights come to the host once); each weighted output is added in
        # ascending expert id.
        # (add_ with alpha takes the weight as a scalar argument; a tensor op with a Python float
        # would wrap it into a tensor first, ~3x the cost of the op here.)
        ids, ws = expert_ids.tolist()[0], weights.tolist()[0]
        acc = torch.zeros_like(hidden)
        for a in sorted(range(len(ids)), key=ids.__getitem__):
            acc.add_(forward(ids[a], hidden), alpha=ws[a])
        return acc
    out = torch.zeros_like(hidden)
    flat_ids = expert_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    token_of = order // expert_ids.shape[1]
    experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
        # clone(): index_add_ with an index that is a view into a larger tensor runs ~300x
        # slower on CPU (torch 2.13), measured in bench/decode.py's prefill.
        idx = order[start : start + count]
        tokens = token_of[start : start + count].clone()
        start += count
        y = forward(expert, hidden[tokens])
        w = weights.reshape(-1)[idx, None]
        out.index_add_(0, tokens, (y * w).to(out.dtype))
    return out


def _project(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    if scale is None:
        # The bias is added after the product (as the reference does), the same arithmetic as
        # the grouped GEMM path (`grouped_experts.run_grouped`).
        y = F.linear(x, weight)
        return y if bias is None else y + bias
    if weight.dtype == torch.uint8:  # MXFP4 blocks [N, K/2] with E8M0 scales [N, K/32]
        return mxfp4_linear(x, weight, scale, bias)
    return int8_linear(x, weight, scale, bias)


def expert_forward(w: ExpertProjections, x: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """One expert's MLP on `x [T, H]` -> [T, H] (int8 projections through `int8_linear`, MXFP4
    through `mxfp4_linear`)."""
    gate_up = _project(x, w.gate_up, w.gate_up_scale, w.gate_up_bias)  # [T, 2I]
    return _project(activation(gate_up, spec), w.down, w.down_scale, w.down_bias)


def split_rows(out_features: int, share: float, align: int = 8) -> int:
    """How many of a projection's `out_features` rows `share` of them is: rounded to `align`
    (whole GEMV tiles on the device), 0 < rows < out_features (both sides get work)."""
    rows = int(round(out_features * share / align)) * align
    return max(align, min(out_features - align, rows)) if out_features > 2 * align else out_features // 2


def expert_forward_split(
    w: ExpertProjections, x: torch.Tensor, spec: MoESpec, device: torch.device, device_rows: int
) -> torch.Tensor:
    """One expert's MLP computed mostly where `w` is (the host) with the last `device_rows` rows of
    its down projection on `device`: `x [T, H]` (on `device`, or already on the host) -> [T, H] on
    `device`.

    The link copies those rows (in `w`'s form, compact ones compact; from pinned memory the copy
    is asynchronous) while the host computes gate/up and the other rows, so one missed expert
    keeps both the link and the CPU busy (q*'s SPLIT). Each output row is the same dot product as
    in `expert_forward`, computed on one side or the other."""
    keep = w.down.shape[0] - device_rows

    def tail(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[keep:].to(device, non_blocking=True)

    down, scale, bias = tail(w.down), tail(w.down_scale), tail(w.down_bias)  # copies start first
    x_host = x.to(w.down.device)
    gate_up = _project(x_host, w.gate_up, w.gate_up_scale, w.gate_up_bias)  # [T, 2I]
    h = activation(gate_up, spec)  # [T, I]
    y_device = _project(h.to(device), down, scale, bias)  # [T, device_rows]

    def head(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:keep]

    y_host = _project(h, head(w.down), head(w.down_scale), head(w.down_bias))  # [T, H - device_rows]
    return torch.cat([y_host.to(device), y_device], dim=-1)
