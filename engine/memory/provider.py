"""TieredExpertProvider: the ExpertStore over an FTW file and a MemoryBudget.

Tiers on a CPU-only machine (tier 1 and tier 2 are both RAM; what differs is the form):
- tier 1 "fast": decoded `ExpertWeights` ready for matmul (budget shared with the KV cache);
  projections stored as int8 stay int8 (`expert_quant` "auto", as in the resident engine): views
  of their stored bytes computed by the fused int8 kernel, a quarter of an fp32 expert's room;
- tier 2 "host": stored FTW block bytes, one tier for all layers; with q* what leaves it (and RAM)
  is the least used expert by decayed routing frequency (`routing.RoutingFrequency`);
- tier 3: the FTW file, read past the page cache (`storage.BlockReader`, O_DIRECT), so the byte
  budgets are the RAM the experts really get and a tier-2 miss really costs a disk read.
With placement "qstar" the two RAM tiers are exclusive for blocks that decode zero-copy (stored
codec = compute dtype, or int8 kept as stored): promoting one moves its buffer from tier 2 to
tier 1 and an eviction demotes it back (`moves.TierMover`), so both budgets hold distinct experts.
On CUDA: tier 1 = device tensors, tier 2 = the compact stored bytes in pinned host memory
(`cuda_path`): a STREAM copies those (MXFP4: ~0.27x the bytes of bf16) and the GPU decodes them,
or with expert_quant "compact" keeps them as they arrived (MXFP4 computed by its GEMV kernel: a
quarter of bf16's room in tier 1 too).
With q*, an expert whose decoded form is no larger (bf16 stored, bf16 compute) leaves tier 2 when
promoted and is copied back when evicted; a compact one keeps its bytes in tier 2.

Placements and their compute paths: `placed_compute.py` (`PlacedCompute`); prefetch:
`provider_prefetch.py` (`PrefetchAhead`); tier 1's room beside the KV cache: `tier_budget.py`
(`FastBudget`); tier 1 filled, warm-started, snapshot and restored, and `stats()`: `tier_state.py`
(`TierState`); decode steps as captured CUDA graphs: `static_steps.py` (`StaticSteps`).

Every placement computes `expert_forward` on identical weight values, and every routed batch goes
through `routed.run_routed` (its per-expert loop, in ascending expert id), so the logits equal the
all-in-RAM engine's whatever the budget.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import EngineError
from ..ftw import FTWFile
from ..kernels.int8 import ExpertQuant, check_expert_quant
from ..model import routed
from ..model.expert_tensors import kept_bytes
from ..model.experts import ExpertKey, ExpertStore, ExpertWeights
from ..model.grouped_experts import run_pair
from ..spec import MoESpec
from .budget import MemoryBudget
from .graph_steps import GraphSteps
from .moves import TierMover
from .oracle import BandwidthOracle, Clock
from .placed_compute import PlacedCompute
from .planner import ExpertPlanner
from .policy import AlwaysStreamPolicy, ComputeCostModel, QStarPolicy
from .prefetch import Prefetcher
from .pregate import AheadRouters
from .provider_prefetch import PrefetchAhead
from .recent import RecentCopies
from .routing import ROUTING_DECAY, RoutingFrequency
from .static_steps import StaticSteps
from .stats import PhaseTimer
from .storage import BlockReader
from .tier_budget import FastBudget
from .tier_state import TierState
from .weights import codec_name


class TieredExpertProvider(PlacedCompute, PrefetchAhead, StaticSteps, FastBudget, TierState, ExpertStore):
    """Experts from `ftw` under `budget` (fast_bytes: tier 1 + KV; host_bytes: tier 2).

    Built by the engine's composition root (`Engine.from_pretrained(..., placement="qstar" |
    "stream")`), which hands it what it needs: the routers (for pre-gating) and the attention
    modules (timed for `stats()`); the engine passes `on_kv_resize` to its KV pool. Built alone
    (tests, tools) it serves `get` and `run` without pre-gating.

    Args:
        top_k: experts per token (int, or per MoE layer); sets the minimum working set.
        dtype: compute dtype of decoded experts. device: "cpu" or "cuda[:N]".
        routers: MoE layer index -> its router module (pre-gating; none: frequency priors only).
        attention: modules whose forward time `stats()` reports as the "attention" phase.
        prefetch: pre-gating prefetch on; `prefetch_thread` False loads inline (deterministic
            tests); `prefetch_depth`: how many MoE layers ahead (CUDA: the staging room is this
            many layers' top-k experts, taken from tier 1).
        hot_every: re-evaluate the pinned hot set every this many steps; `decay`: per-step decay
            of routing frequencies.
        placement: "qstar" (cost model, shared fast LRU + pinned hot set, exclusive RAM tiers) or
            "stream" (baseline: always stream into a per-layer LRU of copies, no hot set).
        direct_io: read tier 3 with O_DIRECT where the filesystem allows (else buffered reads
            dropped from the page cache after each read).
        expert_quant: "auto" | "int8" | "compact" | "none" (`int8.EXPERT_QUANTS`): which
            projections tier 1 and HOST compute keep compact (int8, MXFP4), as the resident
            engine does; on a GPU tier 1 keeps them only with "compact" ("int8": EngineError),
            and HOST compute keeps MXFP4 compact with "auto" too.
    Raises MemoryBudgetError if fast_bytes cannot hold one layer's top_k largest experts;
    EngineError for an unknown `expert_quant`, or "int8" on a GPU.
    """

    def __init__(
        self,
        ftw: FTWFile | str | os.PathLike[str],
        budget: MemoryBudget,
        *,
        top_k: int | Mapping[int, int],
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        routers: Mapping[int, torch.nn.Module] | None = None,
        attention: Sequence[torch.nn.Module] = (),
        prefetch: bool = True,
        prefetch_thread: bool = True,
        policy: QStarPolicy | None = None,
        clock: Clock = time.monotonic,
        hot_every: int = 16,
        decay: float = ROUTING_DECAY,
        max_pinned_fraction: float = 0.5,
        placement: str = "qstar",
        direct_io: bool = True,
        prefetch_depth: int = 3,
        expert_quant: ExpertQuant = "auto",
        expert_slots: bool | None = None,
    ) -> None:
        if placement not in ("qstar", "stream"):
            raise ValueError(f"placement must be 'qstar' or 'stream', got {placement!r}")
        self.expert_quant = check_expert_quant(expert_quant)  # a public entry point (built directly)
        self.ftw = ftw if isinstance(ftw, FTWFile) else FTWFile(Path(ftw))
        self.budget, self.dtype, self.device = budget, dtype, torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        if self.cuda and self.expert_quant == "int8":
            raise EngineError(
                "expert_quant='int8' with tiered experts runs on the CPU only: tier 1 on the GPU holds "
                f"experts decoded to {dtype} or, with expert_quant='compact', as stored (int8 blocks are "
                "computed in int8 when q* runs them on the CPU); use 'auto' or 'compact'"
            )
        self.clock, self.placement = clock, placement
        keys = self.ftw.expert_keys()
        self.stored_bytes = {k: self.ftw.expert_info(*k).stored_length for k in keys}
        # Tier 1 keeps projections compact as the resident engine does; on the GPU only with
        # "compact" (the MXFP4 GEMV kernel; int8 there has no fused kernel, so "auto" decodes).
        tier1_quant = self.expert_quant if not self.cuda or self.expert_quant == "compact" else "none"
        # HOST computes run on the CPU from tier 2's compact bytes, decoded per use whatever the
        # form; on a GPU machine (where HOST and tier-1 results differ in the last bits anyway) an
        # MXFP4 block is then computed from its 4-bit bytes under "auto" too: the CPU decodes a block
        # of rows at a time in cache, 1.2-4.8x faster than decoding the whole expert first
        # (bench/mxfp4_cpu.py), and the rate `--profile-here` measures and the simulator prices.
        # On a CPU-only machine HOST keeps the resident engine's form: the same bits as tier 1.
        host_quant: ExpertQuant = self.expert_quant
        if self.cuda and host_quant == "auto":
            host_quant = "compact"
        self.fast_bytes = {k: kept_bytes(self.ftw.expert_info(*k).tensors, tier1_quant, dtype) for k in keys}
        self.codec = {k: codec_name(self.ftw, k) for k in keys}
        self.layers = sorted({k[0] for k in keys})
        self.routing = RoutingFrequency(self.layers, decay)
        self.top_k = {lay: top_k if isinstance(top_k, int) else top_k[lay] for lay in self.layers}
        self.min_working_set = max(
            sum(sorted((self.fast_bytes[k] for k in keys if k[0] == lay), reverse=True)[: self.top_k[lay]])
            for lay in self.layers
        )
        if placement == "stream":
            self.min_working_set *= len(self.layers)  # every layer needs its own top-k room
        self.kv_bytes = self.spare_bytes = 0
        self.exclusive = placement == "qstar"
        self._prefetch_wanted = prefetch
        self.hot_every = hot_every
        self._staging_slot = max(self.fast_bytes.values(), default=0)  # one staged copy's room
        self._adaptive_staging = self.cuda and self.exclusive and prefetch  # q*'s room follows the link
        self.storage_link = BandwidthOracle("storage->host", clock=clock, prior_bps=1e9)
        self.fast_link = BandwidthOracle("host->fast", clock=clock, prior_bps=1e10)
        # The transfer alone is timed (not queueing or checksums).
        self.reader = BlockReader(self.ftw, direct=direct_io, on_transfer=self.storage_link.record)
        self.act_link = BandwidthOracle("activations", clock=clock, prior_bps=1e10) if self.cuda else None
        policy_cls = AlwaysStreamPolicy if placement == "stream" else QStarPolicy
        self.policy = policy or policy_cls(
            self.storage_link,
            self.fast_link,
            self.act_link,
            ComputeCostModel(),
            fast_device=self.device.type,
            host_device="cpu-host",
        )
        self._timer: Any = None
        if self.cuda:  # expert compute and device decodes, event-timed for q*
            from .cuda_path import ComputeTimer

            self._timer = ComputeTimer(self.policy.compute, self.device.type)
        self.phases = PhaseTimer()
        self.moves = TierMover(
            self.ftw,
            dtype,
            self.device,
            self.reader,
            (self.storage_link, self.fast_link),
            self.phases,
            cuda=self.cuda,
            exclusive=self.exclusive,
            stored_bytes=self.stored_bytes,
            fast_bytes=self.fast_bytes,
            placement=placement,
            n_layers=len(self.layers),
            host_bytes=budget.host_bytes,
            max_pinned_fraction=max_pinned_fraction,
            # What leaves RAM under q* is the least used expert (decayed routing frequency), not
            # the least recently used: replaying the offload bench model's routing, 7.8 instead
            # of 8.9 disk reads per decode token (bench/eviction.py).
            rank=self.routing if self.exclusive else None,
            # Needed soon (this layer's, the predictions for the next ones): evicted last.
            protected=(lambda key: self.planner.needed_soon(key)) if prefetch else None,
            timer=self._timer,
            codecs=self.codec,
            expert_quant=host_quant,
            tier1_quant=tier1_quant,
            slots=self.cuda and placement == "qstar" if expert_slots is None else expert_slots,
        )
        self.fast, self.host = self.moves.fast, self.moves.host
        self._lock = self.moves.lock
        self.planner = ExpertPlanner(
            fast=self.fast,
            host=self.host,
            policy=self.policy,
            routing=self.routing,
            layers=self.layers,
            stored_bytes=self.stored_bytes,
            fast_bytes=self.fast_bytes,
            codecs=self.codec,
            link_bytes=self.moves.link_bytes,
            moves_up=self.moves.moves_up,
            device=self.device.type,
            lock=self._lock,
            hot_every=hot_every,
            clock=clock,
        )
        if self._adaptive_staging and self._staging_slot:  # staged copies kept a while (`RecentCopies`)
            biggest = max(self.fast_bytes, key=self.fast_bytes.__getitem__)
            estimate, host = self.policy.compute.estimate, self.policy.host_device
            self.planner.recent = RecentCopies(
                self.fast,
                self.routing,
                slot_bytes=self._staging_slot,
                top_k=max(self.top_k.values(), default=1),
                floor_bytes=self.min_working_set,
                window=hot_every,
                miss_s=lambda: estimate(host, self.codec[biggest], 1),
            )
        # CUDA: the staging buffer holds copies for the next `prefetch_depth` layers.
        self.prefetch_depth = max(1, prefetch_depth)
        # Each MoE layer's next `prefetch_depth` MoE layers (a lookup per layer, not a search).
        self._ahead = {
            lay: self.layers[i + 1 : i + 1 + self.prefetch_depth] for i, lay in enumerate(self.layers)
        }
        self._apply_fast_budget()
        # Two loader threads: one verifies (and on CUDA copies into pinned memory) the block it
        # read while the other reads the next; the reader keeps reads one at a time.
        self.prefetcher = (
            Prefetcher(self._prefetch_load, use_thread=prefetch_thread, loaders=2) if prefetch else None
        )
        self.routers: dict[int, torch.nn.Module] = dict(routers or {})
        # A decode step pre-gates the next `prefetch_depth` layers in one router pass.
        self.ahead_routers = (
            AheadRouters(self.routers, self.layers, self.prefetch_depth) if prefetch else None
        )
        slots = self.moves.slots
        self.graph_steps = GraphSteps(slots, self._note_resident, self.layers[0]) if slots and keys else None
        self._hooks: list[Any] = [h for module in attention for h in self.phases.hook(module, "attention")]
        self._hidden_host: tuple[torch.Tensor, torch.Tensor] | None = None  # (`_on_host`)

    # ---- the ExpertStore interface -----------------------------------------------------
    def get(self, layer: int, expert: int) -> ExpertWeights:
        """The expert's weights on the compute device (promotes it to tier 1 when it fits)."""
        key = (layer, expert)
        w = self.fast.get(key)
        return w if w is not None else self.moves.promote(key, None)

    def run(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, spec: MoESpec
    ) -> torch.Tensor:
        """hidden [T, H], expert_ids [T, A], weights [T, A] -> [T, H] by `routed.run_routed`: each
        expert computed where its placement says (`_compute`), or, a decode step whose experts are
        all in tier 1, straight from them (`_run_resident`). In a static decode step
        (`static_step`), over tier 1's slot pool with no host sync (`graph_steps.GraphSteps`)."""
        if self.graph_steps is not None and self.graph_steps.recording_now:
            return self.graph_steps.run(layer, hidden, expert_ids, weights, spec)
        if self._timer is not None:
            self._timer.poll()
        decode = hidden.shape[0] == 1
        used = sorted(set(expert_ids.tolist()[0] if decode else expert_ids.reshape(-1).tolist()))
        self.planner.note_routing(layer, used)
        if self._adaptive_staging and layer == self.layers[0] and self.planner.steps % self.hot_every == 0:
            self._refit_staging()
        # Pre-gating (its router runs cost ~1 ms a token on a small CPU model) only while there is
        # something to prefetch. In RAM: tier 2's blocks and, with exclusive tiers, the tier-1
        # experts whose bytes moved up (not in tier 2 any more).
        in_ram = len(self.host) + (len(self.moves.backing) if self.exclusive else 0)
        if self.prefetcher is not None and self.planner.prefetch_has_work(in_ram):
            self.planner.begin_layer(layer, used)
            self.prefetcher.begin_layer(layer, used)
            self._prefetch_next(layer, hidden)
        if decode:
            with self._lock:  # one lookup over the layer's row of tier 1 (`FastTier.hits`)
                resident = self.fast.hits(layer, used)
            if self.graph_steps is not None:
                self.graph_steps.note_eager_layer(layer, resident is not None)
            if resident is not None:  # the common decode step: no per-expert decision at all
                experts = dict(zip(used, resident, strict=True))
                return self._run_resident(layer, experts, hidden, expert_ids, weights, spec)
        self._hidden_host = None  # this layer's hidden state on the CPU, copied once (`_on_host`)
        return routed.run_routed(
            hidden, expert_ids, weights, spec, compute=lambda e, x: self._compute(layer, e, x, spec)
        )

    def _run_resident(
        self,
        layer: int,
        experts: dict[int, ExpertWeights],
        hidden: torch.Tensor,
        expert_ids: torch.Tensor,
        weights: torch.Tensor,
        spec: MoESpec,
    ) -> torch.Tensor:
        """A decode step whose routed experts are all in tier 1: counted as RESIDENT in bulk and
        timed once (each expert credited an equal share for q*'s compute model). All in the slot
        pool where the grouped GEMM is the faster kernel (`routed.use_grouped`: a GPU): one
        grouped GEMM per projection over the slots; a CPU top-2 step of float slots: both experts
        as one batched GEMV per projection (`routed.run_routed`'s top-2 pair, as the resident
        engine runs them); else the loop over the experts' weights."""
        self.policy.count_resident(len(experts), 1)
        pool = self.moves.slots.pool if self.moves.slots is not None else None
        if (
            pool is not None
            and (
                routed.use_grouped(pool.stack, hidden.shape[0])
                or (len(experts) == 2 and expert_ids.shape == (1, 2) and pool.stack.gate_up_scale is None)
            )
            and all((layer, e) in pool for e in experts)
        ):
            slot_ids, _ = pool.lookup(layer, expert_ids)
            if routed.use_grouped(pool.stack, hidden.shape[0]):
                run = lambda: routed.run_routed(  # noqa: E731
                    hidden, slot_ids, weights, spec, stack=pool.stack, get=pool.weights
                )
            else:  # CPU top-2 pair of float slots, added in ascending expert id as the loop does
                slots, keys = slot_ids.tolist()[0], expert_ids.tolist()[0]
                run = lambda: run_pair(pool.stack, hidden, slots, weights, spec, keys)  # noqa: E731
        else:
            run = lambda: routed.run_routed(hidden, expert_ids, weights, spec, get=experts.__getitem__)  # noqa: E731
        if self._timer is not None:
            start = self._timer.start()
            y = run()
            self._timer.stop(start, 1, len(experts))  # folded in by poll(), no sync
            return y
        t0 = time.perf_counter()
        y = run()
        took = time.perf_counter() - t0
        self.phases.add("experts", took)
        if len(self.fast) < len(self.stored_bytes):  # all in tier 1: no decision to price yet
            n = len(experts)
            self.policy.compute.observe(self.device.type, "decoded", 1, took / n, times=n)
        return y

    def keys(self) -> list[ExpertKey]:
        """Every ``(layer, expert)`` the file holds, in memory or not, sorted."""
        return self.ftw.expert_keys()

    def weights_file(self) -> tuple[Path, int] | None:
        return Path(self.ftw.path), self.ftw.fileno()

    def close(self) -> None:
        """Stop the loader threads, remove the attention hooks, close the tier-3 reader."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.reader.close()
