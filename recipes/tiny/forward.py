"""The model's forward over a batch whose dialogues share one system block (the block runs once,
its KV cache repeated for the rows), and distillation: a teacher's next-token distributions as a
second target for the coding and world dialogues."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .corpus import Kind
from .examples import Example


def shared_block_forward(model: Any, block: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, **kw: Any):
    """The model's forward over `block` [P] followed by each row of `ids` [B, T]: the block runs
    once (with gradients) and its KV cache is repeated for the rows."""
    out = model(input_ids=block[None], use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    cache.batch_repeat_interleave(ids.shape[0])
    p = block.shape[0]
    positions = torch.arange(p, p + ids.shape[1], device=ids.device).expand_as(ids)
    return model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=False,
        **{cache_argument(model): cache},
        **kw,
    )


def distillation_loss(
    logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions, averaged over the labelled tokens
    (`labels` [B, T] as the model's own loss takes them: position t predicts label t + 1).

    Learning without forgetting (Li & Hoiem 2016; Hinton et al. 2015): the whole distribution of a
    model that already writes the code is a denser target than the one right token, so a
    continuation that learns the user's tools keeps what the teacher knew."""
    mask = labels[:, 1:] != -100  # [B, T-1]
    student = torch.log_softmax(logits[:, :-1][mask].float(), dim=-1)  # [N, V]
    target = torch.log_softmax(teacher_logits[:, :-1][mask].float(), dim=-1)  # [N, V]
    return torch.nn.functional.kl_div(student, target, log_target=True, reduction="batchmean")


def distilled_blocks(examples: list[Example], kinds: list[Kind]) -> set[tuple[int, ...]]:
    """The system blocks of the coding and world dialogues: the batches a teacher keeps (a batch
    holds the dialogues of one system block). A generic tool set is never one of them."""
    kept = {block for (block, _, _), kind in zip(examples, kinds, strict=True) if kind != "generic"}
    if any(block in kept for (block, _, _), kind in zip(examples, kinds, strict=True) if kind == "generic"):
        raise ValueError("a generic dialogue shares its system block with a coding or world dialogue")
    return kept


def cache_argument(model: Any) -> str:
    """The name `model.forward` takes its KV cache by: `cache` in recent transformers 5 releases,
    `past_key_values` before (deprecated since, and removed in 5.40)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
