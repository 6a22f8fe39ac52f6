"""`FTWExpertProvider`: experts read from an FTW file on first use, one block at a time.

The MoE block asks for the experts its router chose; this provider reads, verifies and decodes only
those blocks (`FTWFile.decode_expert`) and keeps the decoded weights, so an expert that never runs
is never read. Decoded experts stay in a plain dict for now; the tiered expert memory (byte budgets,
eviction, prefetch) replaces that dict later without changing this interface.

Blocks hold the canonical projections (`experts.py`): ``gate_up [2I, H]`` (or ``gate`` and ``up``
``[I, H]`` stored separately, as pre-quantized DeepSeek-V3 fp8 imports keep them), ``down [H, I]``,
optional ``gate_up_bias [2I]`` and ``down_bias [H]``.
"""

from __future__ import annotations

import logging
import threading

import torch

from ..errors import FTWFormatError
from ..experts import ExpertKey, ExpertWeights, run_experts
from ..spec import MoESpec
from .reader import FTWFile

logger = logging.getLogger(__name__)

_KNOWN = {"gate_up", "gate", "up", "down", "gate_up_bias", "down_bias"}


def canonical_expert(
    tensors: dict[str, torch.Tensor], *, path: str = "", key: ExpertKey | None = None
) -> dict[str, torch.Tensor]:
    """Decoded block projections -> the canonical ``ExpertWeights`` names (joins split gate/up).

    Raises FTWFormatError (naming ``path`` and ``key``) for unknown or missing projections.
    """
    where = f"{path}: expert block (layer={key[0]}, expert={key[1]})" if key else path or "expert block"
    unknown = set(tensors) - _KNOWN
    if unknown:
        raise FTWFormatError(f"{where}: unknown projections {sorted(unknown)}")
    out = dict(tensors)
    if "gate" in out or "up" in out:
        if "gate_up" in out or "gate" not in out or "up" not in out:
            raise FTWFormatError(f"{where}: needs either 'gate_up' or both 'gate' and 'up'")
        out["gate_up"] = torch.cat([out.pop("gate"), out.pop("up")], dim=0)
    for name in ("gate_up", "down"):
        if name not in out:
            raise FTWFormatError(f"{where}: missing projection {name!r}")
    return out


class FTWExpertProvider:
    """An `ExpertProvider` over an open `FTWFile`.

    Args:
        ftw: the open file (the provider reads from it for as long as it is used; it does not
            close it).
        dtype: floating dtype of the decoded weights (the engine's compute dtype).
        device: where decoded experts live ("cpu" or "cuda[:N]").

    Counters (cumulative, thread-safe):
        experts_loaded: number of distinct experts read and decoded so far.
        bytes_read: bytes of the expert blocks it decoded and keeps (block headers + stored bytes);
            `FTWFile.bytes_read` counts every read of the file.
    """

    def __init__(self, ftw: FTWFile, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        self.ftw = ftw
        self.dtype = dtype
        self.device = torch.device(device)
        self.experts_loaded = 0
        self.bytes_read = 0
        self._experts: dict[ExpertKey, ExpertWeights] = {}
        self._lock = threading.Lock()

    def keys(self) -> list[ExpertKey]:
        """Every ``(layer, expert)`` the file holds (loaded or not), sorted."""
        return self.ftw.expert_keys()

    def loaded_keys(self) -> list[ExpertKey]:
        """The experts decoded so far, sorted."""
        with self._lock:
            return sorted(self._experts)

    @property
    def nbytes(self) -> int:
        """Bytes of the decoded experts held in memory."""
        with self._lock:
            return sum(w.nbytes for w in self._experts.values())

    def get(self, layer: int, expert: int) -> ExpertWeights:
        """The decoded expert, reading and verifying its block on first use.

        Raises FTWFormatError (naming file, block and offset) when the block is missing, corrupted
        or holds unexpected projections.
        """
        key = (layer, expert)
        with self._lock:
            w = self._experts.get(key)
        if w is not None:
            return w
        info = self.ftw.expert_info(layer, expert)
        decoded = self.ftw.decode_expert(layer, expert, self.dtype)
        tensors = canonical_expert(decoded, path=self.ftw.path, key=key)
        # packed() copies into one owned storage: the decoded views may alias the read buffer.
        w = ExpertWeights.packed(tensors, self.dtype)
        if self.device.type != "cpu":
            w = _to_device(w, self.device)
        with self._lock:
            if key in self._experts:  # another thread won the race; keep its copy
                return self._experts[key]
            self._experts[key] = w
            self.experts_loaded += 1
            self.bytes_read += info.block_length
        logger.debug("loaded expert %s from %s (%d bytes)", key, self.ftw.path, info.block_length)
        return w

    def run(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, spec: MoESpec
    ) -> torch.Tensor:
        """hidden [T, H], expert_ids [T, A] (int64), weights [T, A] -> [T, H]; loads what it needs."""
        return run_experts(self.get, layer, hidden, expert_ids, weights, spec)


def _to_device(w: ExpertWeights, device: torch.device) -> ExpertWeights:
    """Move a packed expert with one copy of its storage; the projections stay views into it."""
    assert w.storage is not None
    storage = w.storage.to(device)
    views: dict[str, torch.Tensor] = {}
    offset = 0
    for name, t in w.tensors().items():
        views[name] = storage[offset : offset + t.numel()].view(t.shape)
        offset += t.numel()
    return ExpertWeights(storage=storage, **views)
