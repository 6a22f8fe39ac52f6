"""What every FTW codec is: `EncodedTensor` (codec name, logical shape and named parts) and the
`Codec` interface (part specs, encode, decode, validate), with the input checks the codecs share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

Shape = tuple[int, ...]


@dataclass(frozen=True, eq=False)
class EncodedTensor:
    """A tensor in one codec's representation.

    Attributes:
        codec: codec name, one of `CODECS`.
        shape: logical (decoded) shape.
        parts: named stored tensors (payload and scales), contiguous CPU tensors whose names, dtypes
            and shapes are fixed by the codec (`Codec.part_specs`).
    """

    codec: str
    shape: Shape
    parts: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))

    @property
    def nbytes(self) -> int:
        """Total bytes of all parts (the size of this tensor in the container, before padding)."""
        return sum(p.numel() * p.element_size() for p in self.parts.values())


def check_float_input(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    """`tensor` detached on the CPU (TypeError: not a tensor; ValueError: not floating point)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"codec {codec!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not (tensor.is_floating_point()):
        raise ValueError(f"codec {codec!r}: expected a floating-point tensor, got {tensor.dtype}")
    return tensor.detach().cpu()


def check_2d(shape: Shape, codec: str) -> tuple[int, int]:
    """`(out, in)` of a 2-D shape (ValueError for any other rank)."""
    if len(shape) != 2:
        raise ValueError(
            f"codec {codec!r} needs a 2-D [out, in] weight, got shape {list(shape)} "
            f"(store 1-D tensors such as biases with 'fp32' or 'bf16')"
        )
    return shape[0], shape[1]


def check_out_dtype(dtype: torch.dtype, codec: str) -> None:
    """ValueError unless a decode's target dtype is floating point."""
    if not dtype.is_floating_point:
        raise ValueError(f"codec {codec!r}: decode dtype must be floating point, got {dtype}")


class Codec(ABC):
    """One quantization scheme. Subclasses are stateless singletons obtained with `get_codec`."""

    name: str = ""

    @abstractmethod
    def part_specs(self, shape: Shape) -> dict[str, tuple[torch.dtype, Shape]]:
        """Return ``{part_name: (dtype, shape)}`` of the parts that encode a tensor of ``shape``.

        Raises ValueError when the codec cannot represent that shape.
        """

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        """Quantize a floating-point CPU tensor (any float dtype) into this codec's parts."""

    @abstractmethod
    def decode(self, enc: EncodedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize ``enc`` to a tensor of ``enc.shape`` and ``dtype``.

        The result may share memory with ``enc.parts`` when no conversion is needed (fp32/bf16
        codecs decoded to their own dtype); treat it as read-only or clone it.
        """

    def validate(self, enc: EncodedTensor) -> None:
        """Raise ValueError unless ``enc`` has exactly this codec's parts (names, dtypes, shapes)."""
        if enc.codec != self.name:
            raise ValueError(f"EncodedTensor has codec {enc.codec!r}, expected {self.name!r}")
        specs = self.part_specs(enc.shape)
        if set(enc.parts) != set(specs):
            raise ValueError(
                f"codec {self.name!r}: parts {sorted(enc.parts)} do not match expected {sorted(specs)}"
            )
        for pname, (dt, shp) in specs.items():
            p = enc.parts[pname]
            if p.dtype != dt or tuple(p.shape) != shp:
                raise ValueError(
                    f"codec {self.name!r}, part {pname!r}: got {p.dtype} {list(p.shape)}, "
                    f"expected {dt} {list(shp)} for logical shape {list(enc.shape)}"
                )
