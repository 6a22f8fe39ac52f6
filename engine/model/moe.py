"""Routers, the MoE block and the dense MLP.

Letters: T tokens, H hidden, E routed experts, A active experts per token, G expert groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..spec import MoESpec
from .experts import ExpertStore
from .layers import linear


class DenseMLP(nn.Module):
    """SwiGLU MLP: dense layers and shared experts (HF names gate_proj / up_proj / down_proj)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, device="meta")
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, device="meta")
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, device="meta")
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.down_proj, F.silu(linear(self.gate_proj, x)) * linear(self.up_proj, x))


class Router(nn.Module):
    """Chooses A experts per token and their weights. `weight [E, H]`, optional bias [E]."""

    def __init__(self, spec: MoESpec, hidden: int) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden, device="meta"), requires_grad=False)
        if spec.router_bias:
            self.bias = nn.Parameter(torch.empty(spec.num_experts, device="meta"), requires_grad=False)
        if spec.routing == "sigmoid_group_topk":
            self.register_buffer("e_score_correction_bias", torch.empty(spec.num_experts, device="meta"))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] (fp32 for DeepSeek, whose router runs in fp32)."""
        if self.spec.routing == "sigmoid_group_topk":
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight, self.bias if self.spec.router_bias else None)

    def choose(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the expert ids [T, A] `forward` picks, without their weights (pre-gating):
        under a softmax the top k of the probabilities are the top k of the logits."""
        if self.spec.routing in ("softmax_topk", "topk_softmax"):
            return self.logits(x).topk(self.spec.top_k, dim=-1)[1]
        return self.forward(x)[0]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, A] int64, weights [T, A])."""
        s = self.spec
        logits = self.logits(x)  # [T, E]
        if s.routing == "softmax_topk" and s.norm_topk_prob:
            # A softmax over all E renormalised over the top k is a softmax over the top-k
            # logits: same experts, same weights, two ops fewer per layer.
            top, ids = logits.topk(s.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1, dtype=torch.float32)
            return ids, weights if x.dtype == torch.float32 else weights.to(x.dtype)
        if s.routing == "softmax_topk":
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = probs.topk(s.top_k, dim=-1)
            if s.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return ids, weights.to(x.dtype)
        if s.routing == "topk_softmax":
            top, ids = logits.topk(s.top_k, dim=-1)
            return ids, torch.softmax(top, dim=-1)
        return self._group_limited(logits)

    def _group_limited(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3: sigmoid scores, bias-corrected choice within the best `topk_group` groups."""
        s = self.spec
        scores = logits.sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias
        t = choice.shape[0]
        per_group = s.num_experts // s.n_group
        group_scores = choice.view(t, s.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        best_groups = group_scores.topk(s.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, best_groups, 1.0)
        expert_mask = group_mask[:, :, None].expand(t, s.n_group, per_group).reshape(t, s.num_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        ids = choice.topk(s.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * s.routed_scaling_factor


class MoEBlock(nn.Module):
    """Router + routed experts (through an ExpertStore) + optional shared experts."""

    def __init__(self, spec: MoESpec, hidden: int, layer: int) -> None:
        super().__init__()
        self.spec, self.layer = spec, layer
        self.router = Router(spec, hidden)
        self.provider: ExpertStore | None = None
        if spec.shared != "none":
            self.shared_expert = DenseMLP(hidden, spec.shared_intermediate_size)
        if spec.shared == "gated":
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False, device="meta").requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.router(x)
        assert self.provider is not None, "MoEBlock used before an ExpertStore was attached"
        out = self.provider.run(self.layer, x, ids, weights, self.spec)
        if self.spec.shared == "gated":
            out = out + torch.sigmoid(linear(self.shared_expert_gate, x)) * self.shared_expert.forward(x)
        elif self.spec.shared == "plain":
            out = out + self.shared_expert.forward(x)
        return out
