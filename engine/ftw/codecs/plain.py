"""The plain codecs: the tensor stored as-is in one float dtype, any rank.

- ``"fp32"``: ``weight`` float32. Exact.
- ``"bf16"``: ``weight`` bfloat16. Exact for inputs already representable in bf16.
"""

from __future__ import annotations

import torch

from .base import Codec, EncodedTensor, Shape, check_float_input, check_out_dtype


class _PlainCodec(Codec):
    """Store the tensor as-is in one float dtype (any rank)."""

    store_dtype: torch.dtype = torch.float32

    def part_specs(self, shape: Shape) -> dict[str, tuple[torch.dtype, Shape]]:
        return {"weight": (self.store_dtype, tuple(shape))}

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        t = check_float_input(tensor, self.name)
        w = t.to(self.store_dtype).contiguous()
        return EncodedTensor(self.name, tuple(t.shape), {"weight": w})

    def decode(self, enc: EncodedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        check_out_dtype(dtype, self.name)
        return enc.parts["weight"].to(dtype)


class FP32Codec(_PlainCodec):
    name = "fp32"
    store_dtype = torch.float32


class BF16Codec(_PlainCodec):
    name = "bf16"
    store_dtype = torch.bfloat16
