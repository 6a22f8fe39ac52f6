"""``"int8"``: symmetric per output channel, 2-D only. ``weight`` int8 ``[out, in]`` in
[-127, 127] and ``scale`` float32 ``[out]``; dequant ``weight * scale[:, None]``. Encode sets
``scale = amax(row) / 127`` (1.0 for an all-zero row).
"""

from __future__ import annotations

import torch

from .base import Codec, EncodedTensor, Shape, check_2d, check_float_input, check_out_dtype


class Int8Codec(Codec):
    """Symmetric int8 with one fp32 scale per output channel (row)."""

    name = "int8"

    def part_specs(self, shape: Shape) -> dict[str, tuple[torch.dtype, Shape]]:
        out, inp = check_2d(shape, self.name)
        return {"weight": (torch.int8, (out, inp)), "scale": (torch.float32, (out,))}

    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        t = check_float_input(tensor, self.name)
        out, inp = check_2d(tuple(t.shape), self.name)
        x = t.to(torch.float32)
        if not torch.isfinite(x).all():
            raise ValueError(f"codec {self.name!r}: input has NaN or inf values")
        amax = x.abs().amax(dim=1) if inp else torch.zeros(out)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).contiguous()
        q = torch.round(x / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        return EncodedTensor(self.name, (out, inp), {"weight": q, "scale": scale})

    def decode(self, enc: EncodedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        check_out_dtype(dtype, self.name)
        check_2d(enc.shape, self.name)
        x = enc.parts["weight"].to(torch.float32)
        x.mul_(enc.parts["scale"].to(torch.float32)[:, None])
        return x if dtype == torch.float32 else x.to(dtype)
