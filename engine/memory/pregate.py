"""Pre-gating: the experts a coming layer's router would pick for the current hidden state.

`pregate(router, hidden, limit)` runs one router. `AheadRouters` runs the routers of a layer's next
`depth` MoE layers as one: their weights are laid out once, consecutively, in one buffer
([layers x E, H]), so the next `depth` layers' weights are one slice of it, and a decode step's
pre-gating is one matmul, one top-k and one read of the ids instead of `depth` of each. On a GPU
every op is a launch (~7.7 us on the H200) and every read of ids a device sync (~11.7 us,
../shared/FACTS.md); on the 2-core dev CPU the tiered provider's per-layer cost went from ~38 to
~28 us (`measure._tiered_overheads_us`, three routers ahead).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..model.moe import Router

TOPK_OF_LOGITS = ("softmax_topk", "topk_softmax")
"""Routings whose experts are the top k of the router's logits (a softmax keeps the order)."""


def pregate(router: torch.nn.Module, hidden: torch.Tensor, limit: int) -> list[int]:
    """Experts `router` would pick for `hidden [T, H]`, most-voted first, <= limit."""
    with torch.inference_mode():
        # The ids only (`Router.choose`: no routing weights, no module call; ~1/4 of a layer's
        # pre-gating on a small CPU model); another router module through its forward.
        ids = router.choose(hidden) if isinstance(router, Router) else router(hidden)[0]  # [T, A]
    if ids.shape[0] == 1:  # decode: one vote each, so ties, taken in expert order
        return sorted(ids[0].tolist())[:limit]  # one read of the ids (one sync on a GPU, not A + 1)
    votes = torch.bincount(ids.reshape(-1))
    order = torch.argsort(votes, descending=True, stable=True)
    return order[: min(limit, int((votes > 0).sum()))].tolist()


class AheadRouters:
    """The routers of the MoE layers `layers` (in order), pre-gated `depth` layers at a time.

    Batched only when every router is a `Router` whose experts are the top k of its logits, all
    alike (experts, top k, hidden size, dtype, device, a bias or none); otherwise `choose` answers
    None and the caller pre-gates layer by layer. The routers' weights (and biases) are laid out in
    one buffer, each router's becoming a view of its rows: no memory is added, and a change made
    in place reaches both. A router whose weight was replaced (`weight.data = ...`) is noticed by
    `choose`, which lays the buffer out again.
    """

    def __init__(self, routers: Mapping[int, torch.nn.Module], layers: Sequence[int], depth: int) -> None:
        self.layers, self.depth = list(layers), depth
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        self.weight: torch.Tensor | None = None  # [layers x E, H]
        self.bias: torch.Tensor | None = None  # [layers x E]
        self._routers: list[Router] = []
        self._weights: list[torch.nn.Parameter] = []  # each router's weight (read without Module.__getattr__)
        self._ptrs: list[int] = []  # each router's weight's address once laid out
        mods = [routers.get(layer) for layer in self.layers]
        if depth < 1 or not mods or not all(_batchable(m) for m in mods):
            return
        routers_ = [m for m in mods if isinstance(m, Router)]
        specs = {(m.spec.num_experts, m.spec.top_k, m.spec.router_bias) for m in routers_}
        forms = {(m.weight.shape, m.weight.dtype, m.weight.device) for m in routers_}
        if len(specs) != 1 or len(forms) != 1:
            return
        self._routers = routers_
        self.experts, self.top_k = routers_[0].spec.num_experts, routers_[0].spec.top_k
        self._lay_out()

    def _lay_out(self) -> None:
        """One buffer for every router's weight (and bias); each router's now views its rows."""
        e, mods = self.experts, self._routers
        with torch.no_grad():
            self.weight = torch.cat([m.weight.data for m in mods])
            if mods[0].spec.router_bias:
                self.bias = torch.cat([m.bias.data for m in mods])
            for i, m in enumerate(mods):
                m.weight.data = self.weight[i * e : (i + 1) * e]
                if self.bias is not None:
                    m.bias.data = self.bias[i * e : (i + 1) * e]
        self._weights = [m.weight for m in mods]
        self._ptrs = [w.data_ptr() for w in self._weights]

    @property
    def batched(self) -> bool:
        return self.weight is not None

    def choose(self, layer: int, hidden: torch.Tensor) -> list[list[int]] | None:
        """Decode (`hidden [1, H]`): the experts each of `layer`'s next `depth` MoE layers' routers
        would pick, sorted, nearest layer first (as `pregate` orders one layer's); None when not
        batched or for a prefill (T > 1: the per-layer vote)."""
        if self.weight is None or hidden.shape[0] != 1:
            return None
        i = self._index[layer] + 1
        n = min(self.depth, len(self.layers) - i)
        if n <= 0:
            return []
        if [w.data_ptr() for w in self._weights[i : i + n]] != self._ptrs[i : i + n]:
            self._lay_out()  # a router's weight was replaced: lay the buffer out again
        if torch.is_inference_mode_enabled():  # the engine's decode step: no second context (~1 us)
            ids = self._top_ids(i, n, hidden)
        else:
            with torch.inference_mode():
                ids = self._top_ids(i, n, hidden)
        return [sorted(row) for row in ids.tolist()]  # one read of the ids (one sync on a GPU)

    def _top_ids(self, i: int, n: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [1, H] -> the top-k expert ids [n, A] of the `n` routers from the `i`-th."""
        e = self.experts
        rows = slice(i * e, (i + n) * e)
        bias = self.bias[rows] if self.bias is not None else None
        logits = torch.nn.functional.linear(hidden, self.weight[rows], bias)  # [1, n x E]
        return logits.view(n, e).topk(self.top_k, dim=-1)[1]


def _batchable(module: torch.nn.Module | None) -> bool:
    return (
        isinstance(module, Router)
        and module.spec.routing in TOPK_OF_LOGITS
        and module.weight.device.type != "meta"
    )
