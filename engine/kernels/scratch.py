"""Per-thread scratch buffers for the CPU's block-at-a-time weight decodes (`int8.dequant_linear`,
`mxfp4.cpu_linear`): a decoded block is written into the same memory on every call, which stays in
cache and is never page-faulted in again."""

from __future__ import annotations

import threading

import torch

_local = threading.local()


def thread_buffer(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of at least `numel` elements of `dtype` on `device`, this thread's own for
    `name`, reused across calls (grown, never shrunk). Read only the first `numel` elements."""
    bufs: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = getattr(_local, "bufs", None) or {}
    _local.bufs = bufs
    key = (name, dtype, device)
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        # A normal tensor (not an inference tensor): written in place inside and outside inference mode.
        with torch.inference_mode(False):
            buf = bufs[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf
