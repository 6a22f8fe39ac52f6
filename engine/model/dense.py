"""Assigning dense weights (everything but the routed experts) to a built `MoETransformer`."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import CheckpointError
from .transformer import MoETransformer


def load_dense_weights(
    model: MoETransformer, get: Callable[[str], torch.Tensor], where: str, dtype: torch.dtype, device: str
) -> None:
    """Assign every dense parameter/buffer of `model` from `get(engine_name)` (shape-checked)."""
    keep_fp32 = model.fp32_parameter_names()
    state: dict[str, torch.Tensor] = {}
    for name, param in [*model.named_parameters(), *model.named_buffers()]:
        tensor = get(name)
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(
                f"tensor for '{name}' in {where} has shape {list(tensor.shape)}, expected {list(param.shape)}"
            )
        state[name] = tensor.to(device=device, dtype=torch.float32 if name in keep_fp32 else dtype)
    model.load_state_dict(state, strict=True, assign=True)
