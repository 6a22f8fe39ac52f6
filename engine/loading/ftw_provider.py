"""`FTWExpertProvider`: experts read from an FTW file on first use, one block at a time.

The MoE block asks for the experts its router chose; this provider reads, verifies and decodes only
those blocks (`FTWFile.encoded_expert`, `expert_tensors`) and keeps the decoded weights, so an
expert that never runs is never read. Decoded experts stay in a plain dict for now; the tiered
expert memory (byte budgets, eviction, prefetch) replaces that dict later without changing this
interface.

Blocks hold the canonical projections (`experts.py`): ``gate_up [2I, H]`` (or ``gate`` and ``up``
``[I, H]`` stored separately, as pre-quantized DeepSeek-V3 fp8 imports keep them), ``down [H, I]``,
optional ``gate_up_bias [2I]`` and ``down_bias [H]``.

Int8 (``expert_quant``, see `int8.EXPERT_QUANTS`): with ``"auto"`` (the default) a projection
stored in FTW's ``int8`` codec is kept as stored, int8 weight + fp32 row scales, never decoded to a
float copy, and computed by `int8.int8_linear`; every other codec is decoded to the engine dtype as
before. ``"int8"`` also quantizes the other codecs' projections to int8 at first use;
``"compact"`` also keeps MXFP4 projections in their 4-bit form (blocks + E8M0 scales, computed by
`mxfp4.mxfp4_linear`); ``"none"`` decodes everything, int8 included, to the engine dtype.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..ftw.reader import FTWFile
from ..kernels.int8 import ExpertQuant
from ..model import routed
from ..model.expert_tensors import expert_tensors, kept_bytes
from ..model.experts import SCALES, ExpertKey, ExpertStore, ExpertWeights
from ..spec import MoESpec

logger = logging.getLogger(__name__)


class FTWExpertProvider(ExpertStore):
    """An `ExpertStore` over an open `FTWFile`.

    Args:
        ftw: the open file (the provider reads from it for as long as it is used; it does not
            close it).
        dtype: floating dtype of the decoded weights (the engine's compute dtype).
        device: where decoded experts live ("cpu" or "cuda[:N]").
        expert_quant: an `int8.ExpertQuant` (module doc), taken as given: `load_ftw` and
            `EngineOptions` check it.

    Counters (cumulative, thread-safe):
        experts_loaded: number of distinct experts read and decoded so far.
        bytes_read: bytes of the expert blocks it decoded and keeps (block headers + stored bytes);
            `FTWFile.bytes_read` counts every read of the file.
    """

    def __init__(
        self,
        ftw: FTWFile,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        expert_quant: ExpertQuant = "auto",
    ) -> None:
        self.ftw = ftw
        self.dtype = dtype
        self.device = torch.device(device)
        self.expert_quant = expert_quant  # checked by its callers (`load_ftw`, `EngineOptions`)
        self.experts_loaded = 0
        self.bytes_read = 0
        self._experts: dict[ExpertKey, ExpertWeights] = {}
        self._lock = threading.Lock()

    def keys(self) -> list[ExpertKey]:
        """Every ``(layer, expert)`` the file holds (loaded or not), sorted."""
        return self.ftw.expert_keys()

    def weights_file(self) -> tuple[Path, int] | None:
        return Path(self.ftw.path), self.ftw.fileno()

    def take_all(self, progress: bool = False) -> dict[ExpertKey, ExpertWeights]:
        """Every expert of the file, read now (those not loaded yet) and handed over: the provider
        keeps no reference, so a caller that restacks them (`InMemoryExpertProvider`) frees each
        expert's own storage as it goes. FTWFormatError as `get`."""
        with self._lock:
            loaded = dict(self._experts)
        out: dict[ExpertKey, ExpertWeights] = {}
        for key in tqdm(
            self.keys(), desc=f"load {Path(self.ftw.path).name}", unit="expert", disable=not progress
        ):
            out[key] = loaded[key] if key in loaded else self.get(*key)
            with self._lock:
                self._experts.pop(key, None)
        return out

    def loaded_keys(self) -> list[ExpertKey]:
        """The experts decoded so far, sorted."""
        with self._lock:
            return sorted(self._experts)

    @property
    def nbytes(self) -> int:
        """Bytes of the decoded experts held in memory."""
        with self._lock:
            return sum(w.nbytes for w in self._experts.values())

    def resident_bytes(self) -> int:
        """Bytes every expert of the file takes once loaded in this provider's form (compact
        projections as kept, the rest in the compute dtype): what all-resident placement needs."""
        infos = (self.ftw.expert_info(*k) for k in self.ftw.expert_keys())
        return sum(kept_bytes(info.tensors, self.expert_quant, self.dtype) for info in infos)

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
        encs = self.ftw.encoded_expert(layer, expert)
        tensors = expert_tensors(encs, self.dtype, self.expert_quant, path=self.ftw.path, key=key)
        # packed*() copy into one owned storage: the tensors may be views of the read buffer.
        if any(name in tensors for name in SCALES):  # compact projections keep their dtypes
            w = ExpertWeights.packed_mixed(tensors, self.device)
        else:
            w = ExpertWeights.packed(tensors, self.dtype)
            if self.device.type != "cpu":
                w = w.to_device(self.device)  # one copy of the storage
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
        """hidden [T, H], expert_ids [T, A] (int64), weights [T, A] -> [T, H] (`routed.run_routed`:
        no stack, so the per-expert loop); loads what it needs."""
        return routed.run_routed(hidden, expert_ids, weights, spec, get=lambda e: self.get(layer, e))
