"""Helpers for moving experts between tiers: sizes, codec names, decoding stored bytes, pinned host
buffers and rebuilding an expert's projection views over another flat storage (device or pinned host)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..ftw import FTWFile
from ..kernels.int8 import ExpertQuant
from ..model.expert_tensors import expert_tensors
from ..model.experts import PROJECTIONS, ExpertKey, ExpertWeights


def codec_name(ftw: FTWFile, key: ExpertKey) -> str:
    return "+".join(sorted({t.codec for t in ftw.expert_info(*key).tensors.values()}))


def decode_block(
    ftw: FTWFile, key: ExpertKey, stored: Any, dtype: torch.dtype, expert_quant: ExpertQuant = "none"
) -> ExpertWeights:
    """Verified stored bytes of `key` -> its canonical weights: int8 projections kept per
    `expert_quant` (`ftw.provider.expert_tensors`), the rest in `dtype`; views into `stored` where
    no conversion is needed (int8 kept, or the codec is `dtype` itself): treat them as read-only."""
    encs = ftw.encoded_stored(key[0], key[1], stored, verify=False)
    return ExpertWeights(**expert_tensors(encs, dtype, expert_quant, path=ftw.path, key=key))


def decode_raw(
    ftw: FTWFile, key: ExpertKey, raw: torch.Tensor, dtype: torch.dtype, expert_quant: ExpertQuant = "none"
) -> ExpertWeights:
    """A block's raw bytes in a uint8 tensor (pinned host or device) -> its canonical weights as
    `decode_block` gives them, decoded where the bytes are."""
    encs = ftw.encoded_raw(key[0], key[1], raw)
    return ExpertWeights(**expert_tensors(encs, dtype, expert_quant, path=ftw.path, key=key))


def pinned_raw(raw: bytes | bytearray | memoryview) -> torch.Tensor:
    """A block's raw bytes copied into one page-locked uint8 host buffer (tier 2 on CUDA: the
    host -> device copy of the compact bytes can then be asynchronous)."""
    out = torch.empty(len(raw), dtype=torch.uint8, pin_memory=True)
    if len(raw):
        with warnings.catch_warnings():  # read-only source (decompressed bytes): only read here
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            out.copy_(torch.frombuffer(raw, dtype=torch.uint8))
    return out


def pinned_storage(w: ExpertWeights, dtype: torch.dtype) -> torch.Tensor:
    """`w`'s projections copied into one flat page-locked host buffer (ExpertWeights.packed order)."""
    parts = [getattr(w, n) for n in PROJECTIONS if getattr(w, n) is not None]
    storage = torch.empty(sum(p.numel() for p in parts), dtype=dtype, pin_memory=True)
    offset = 0
    for p in parts:
        storage[offset : offset + p.numel()].view(p.shape).copy_(p)
        offset += p.numel()
    return storage


def rebase(w: ExpertWeights, storage: torch.Tensor) -> ExpertWeights:
    """`w`'s views rebuilt over `storage` (same layout as ExpertWeights.packed)."""
    views: dict[str, torch.Tensor] = {}
    offset = 0
    for name, src in ((n, getattr(w, n)) for n in PROJECTIONS):
        if src is None:
            continue
        views[name] = storage[offset : offset + src.numel()].view(src.shape)
        offset += src.numel()
    return ExpertWeights(storage=storage, **views)
