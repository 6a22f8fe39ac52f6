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

Placements (per expert per step, `QStarPolicy`):
- RESIDENT: in tier 1; compute there.
- STREAM: bring it into tier 1 (reading tier 3 if needed; CPU: decode or move; CUDA: async copy
  of the compact bytes on a side stream that compute waits for by event, then a GPU decode),
  keep it there (may evict), compute there.
- HOST: compute where the weights are: CPU: from the tier-2 bytes (decoded transiently; read from
  tier 3 into tier 2 first if absent); CUDA: on the CPU from the pinned compact bytes (decoded
  there transiently), moving activations.
`placement="stream"` is the mixtral-offloading design kept as a baseline: a per-layer LRU of
decoded copies in tier 1 (`LayerLRUTier` + `AlwaysStreamPolicy`), tier 2 independent of it.

Prefetch (`Prefetcher`): pre-gating predicts the next `prefetch_depth` layers' experts while a
layer computes; loader threads read them into tier 2 (CPU) or, on CUDA, also copy them into staging
room on the device when the link can land them in time (`ExpertPlanner.should_stage`), so disk
reads and copies overlap compute; q* then keeps a staged expert (STREAM) or computes it once from
its staged copy (STAGED, evicting nothing from the LRU; the copy may stay a token or two in tier
1's recent segment, sized by `RecentCopies`). The experts predicted for the
coming layers are "needed soon": the tiers evict them last, so a prefetch never pushes out what
the next layers are about to use.

Every placement computes `expert_forward` on identical weight values, and every routed batch goes
through `routed.run_routed` (its per-expert loop, in ascending expert id), so the logits equal the
all-in-RAM engine's whatever the budget.

Fast memory is shared with the KV cache: the engine gives `on_kv_resize` to its BlockPool as
`on_resize`; KV growth shrinks tier 1 (prefetch staging first, then coldest experts,
pinned last; zero-copy blocks are demoted to tier 2), freed KV regrows it. MemoryBudgetError when
even one layer's top_k experts cannot fit (at construction, or when KV would take that room; the
KV block is then refused and the session keeps its state).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import EngineError, MemoryBudgetError
from ..ftw import FTWFile
from ..kernels.int8 import ExpertQuant, check_expert_quant
from ..model import routed
from ..model.expert_tensors import kept_bytes
from ..model.experts import ExpertKey, ExpertStore, ExpertWeights
from ..model.grouped_experts import run_pair, stack_capturable
from ..model.routed import expert_forward
from ..spec import MoESpec
from .budget import MemoryBudget, format_size
from .graph_steps import GraphSteps
from .moves import TierMover
from .oracle import BandwidthOracle, Clock
from .planner import ExpertPlanner
from .policy import DOWN_SHARE, AlwaysStreamPolicy, ComputeCostModel, Placement, QStarPolicy
from .prefetch import Prefetcher
from .pregate import AheadRouters
from .recent import RecentCopies
from .routing import ROUTING_DECAY, RoutingFrequency
from .routing_trace import Step
from .stats import PhaseTimer
from .storage import BlockReader
from .weights import codec_name

logger = logging.getLogger(__name__)


class TieredExpertProvider(ExpertStore):
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

    # ---- budget ---------------------------------------------------------------------------
    def _apply_fast_budget(self) -> None:
        total = self.budget.fast_bytes
        if total is None:
            self._set_spare(self._target_spare())
            self.fast.resize(None)
            return
        avail = total - self.kv_bytes
        if avail < self.min_working_set:
            need = self.kv_bytes + self.min_working_set
            raise MemoryBudgetError(
                f"fast memory budget of {total} bytes cannot hold the KV cache ({self.kv_bytes} "
                f"bytes) plus the minimum expert working set ({self.min_working_set} bytes: one "
                f"layer's top-k experts); raise MemoryBudget.fast_bytes to at least {need} bytes "
                f"({format_size(need)}) or shorten the context",
                option="fast_bytes",
                minimum_bytes=need,
            )
        # Prefetch staging (the spare half of the double buffer) goes first under pressure. On a
        # CPU-only machine prefetch reads ahead into tier 2 only: HOST computes straight from the
        # stored bytes, so decoded staging copies would only take room from tier 1.
        self._set_spare(self._target_spare())
        evicted = self.fast.resize(avail - self.spare_bytes)  # `moves` demotes or spills them
        if self.planner.recent is not None:
            evicted += self.planner.recent.fit()
        self.moves.fit_slots()
        if evicted:
            logger.debug("fast tier shrank to %d bytes: evicted %s", avail - self.spare_bytes, evicted)

    def _staging_bytes(self) -> int:
        """CUDA prefetch staging: room for the copies that wait at once (`ExpertPlanner.staging_room`:
        every expert predicted for the next `prefetch_depth` layers until a layer time is measured,
        then what the link can land in that time), each the size of the largest expert."""
        if not (self._prefetch_wanted and self.cuda):
            return 0
        if not self.exclusive:  # the "stream" baseline (per-layer LRU) as it was measured
            return self.prefetch_depth * self.min_working_set
        return self.planner.staging_room(self.prefetch_depth, max(self.top_k.values())) * self._staging_slot

    def _target_spare(self) -> int:
        """The staging room the fast budget gives now: none if tier 1 would be left less than the
        minimum working set."""
        wanted = self._staging_bytes()
        total = self.budget.fast_bytes
        if total is None or total - self.kv_bytes - wanted >= self.min_working_set:
            return wanted
        return 0

    def _set_spare(self, spare: int) -> None:
        """The staging room is `spare` bytes: as many staged copies may wait at once."""
        self.spare_bytes = spare
        self.planner.room = spare // self._staging_slot if spare else None

    def _refit_staging(self) -> None:
        """CUDA, every `hot_every` steps: the staging room follows what the link can fill; what it
        no longer needs goes back to tier 1 (and what it needs again comes from tier 1)."""
        room = self.planner.staging_room(self.prefetch_depth, max(self.top_k.values()))
        if not self.planner.room_settled(room) and self._target_spare() != self.spare_bytes:
            with self._lock:
                self._apply_fast_budget()

    def on_kv_resize(self, kv_bytes: int) -> None:
        """BlockPool.on_resize: KV now needs `kv_bytes` of fast memory; resize the expert tier."""
        old = self.kv_bytes
        self.kv_bytes = kv_bytes
        try:
            with self._lock:
                self._apply_fast_budget()
        except MemoryBudgetError:
            self.kv_bytes = old
            raise

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

    def _compute(self, layer: int, expert: int, x: torch.Tensor, spec: MoESpec) -> torch.Tensor:
        key = (layer, expert)
        t = x.shape[0]
        w = self.fast.get(key)
        if w is not None:  # RESIDENT is the only placement q* prices for it: no decision to make
            self.policy.count_resident(1, t)
            return self._fast_compute(w, x, spec)
        staged = None
        if self.prefetcher is not None:
            with self.phases.time("wait_prefetch"):
                staged = self.prefetcher.take(key)
        place = self.planner.decide(
            key, t, staged=staged is not None, activation_bytes=2 * x.numel() * x.element_size()
        )
        if place is Placement.HOST:
            return self._host_compute(key, x, spec, staged)
        if place is Placement.STAGED:  # computed from the prefetch's copy: let go or kept a while
            if self.planner.keeps_staged(key):
                w = self.moves.promote(key, staged, recent=True)
                self.planner.recent.observe_keep(self.moves.last_put_s)  # type: ignore[union-attr]
                return self._fast_compute(w, x, spec)
            return self._fast_compute(self.moves.use_staged(key, staged), x, spec)
        if place is Placement.SPLIT:
            return self._split_compute(key, x, spec, self.planner.take_split(key))
        return self._fast_compute(self.moves.promote(key, staged), x, spec)

    def _fast_compute(self, w: ExpertWeights, x: torch.Tensor, spec: MoESpec) -> torch.Tensor:
        """Compute one expert in tier 1, timing it for q*'s compute model."""
        t = x.shape[0]
        if self._timer is not None:
            start = self._timer.start()
            y = expert_forward(w, x, spec)
            self._timer.stop(start, t)  # folded in by poll(), no sync
            return y
        t0 = time.perf_counter()  # (not `phases.time`: a context manager's ~1.5 us, on every miss)
        y = expert_forward(w, x, spec)
        took = time.perf_counter() - t0
        self.phases.add("experts", took)
        self.policy.compute.observe(self.device.type, "decoded", t, took)
        return y

    def _host_compute(self, key: ExpertKey, x: torch.Tensor, spec: MoESpec, staged: Any) -> torch.Tensor:
        """HOST: compute from the tier-2 weights (CPU: the stored bytes, decoded transiently;
        CUDA: the pinned compact bytes decoded on the CPU, moving only the activations)."""
        value = self.moves.host_value(key) if self.cuda or staged is None else staged
        t0 = time.perf_counter()  # after any disk read: q* prices that with the storage link
        if self.cuda:
            w = self.moves.decode(key, value)
            y = expert_forward(w, self._on_host(x), spec).to(self.device, non_blocking=True)
        else:
            with self.phases.time("experts"):
                y = expert_forward(self.moves.decode(key, value), x, spec)
        self.policy.compute.observe("cpu-host", self.codec[key], x.shape[0], time.perf_counter() - t0)
        return y

    def _on_host(self, x: torch.Tensor) -> torch.Tensor:
        """CUDA: `x` on the CPU. A decode step runs every routed expert of a layer on the same
        hidden tensor, so it crosses once per layer (`run` clears the copy before each layer): a
        second HOST or SPLIT expert of the layer no longer waits, on a device sync, for the GPU
        work queued since the first (the tier-1 experts between them in expert order)."""
        held = self._hidden_host
        if held is not None and held[0] is x:
            return held[1]
        on_host = x.to("cpu")
        self._hidden_host = (x, on_host)
        return on_host

    def _split_compute(self, key: ExpertKey, x: torch.Tensor, spec: MoESpec, share: float) -> torch.Tensor:
        """SPLIT (CUDA): HOST, but the last `share` of the down projection's rows are copied (from
        the pinned tier-2 bytes where the CPU's form of them is a view, so asynchronously) and
        computed on the device (`routed.expert_forward_split`). The CPU's time is observed as a
        whole expert's: divided by the share of the expert it computed."""
        value = self.moves.host_value(key)
        t0 = time.perf_counter()
        w = self.moves.decode(key, value)
        rows = routed.split_rows(w.down.shape[0], share)
        y = routed.expert_forward_split(w, self._on_host(x), spec, self.device, rows)
        cpu_share = 1 - DOWN_SHARE * rows / w.down.shape[0]
        took = (time.perf_counter() - t0) / cpu_share
        self.policy.compute.observe("cpu-host", self.codec[key], x.shape[0], took)
        moved = sum(t[-rows:].nbytes for t in (w.down, w.down_scale, w.down_bias) if t is not None)
        with self._lock:
            self.moves.bytes_moved["host->fast"] += moved
        return y

    # ---- static (CUDA-graph) decode steps ----------------------------------------------------
    @property
    def graph_safe(self) -> bool:  # type: ignore[override]
        """A decode step can run on the device alone: tier 1 is a slot pool that can hold every
        expert of the file (one layout: float, int8 or MXFP4) and its grouped kernels (GEMM or
        GEMVs) are capturable there."""
        codec = self.moves.tier1_codec
        if self.moves.slots is None or not self.cuda or codec is None:
            return False
        return stack_capturable(codec, self.device, self.dtype)

    @property
    def graph_epoch(self) -> int:  # type: ignore[override]
        """Changes when the slot pool's buffer moves (a captured graph must be captured again)."""
        return self.moves.slots.epoch if self.moves.slots is not None else 0

    @property
    def graph_wanted(self) -> bool:  # type: ignore[override]
        """Whether a replay is likely to hit: most recent decode steps ran all in tier 1."""
        return self.graph_steps is not None and self.graph_steps.wanted

    def static_step(self) -> AbstractContextManager[None]:
        return self.graph_steps.recording() if self.graph_steps is not None else nullcontext()

    def finish_static_step(self) -> bool:
        return self.graph_steps.finish() if self.graph_steps is not None else True

    def _note_resident(self, layer: int, used: Sequence[int]) -> None:
        """A static step ran `layer` with `used` all from tier 1: noted as an eager step notes it."""
        self.planner.note_routing(layer, used)
        with self._lock:
            self.fast.get_all([(layer, e) for e in used])
        self.policy.count_resident(len(used), 1)

    # ---- prefetch ---------------------------------------------------------------------------
    def _prefetch_load(self, key: ExpertKey) -> Any:
        wanted = self.prefetcher.wanted if self.prefetcher is not None else None
        # CUDA: a copy is staged only when the link can land it in time (`should_stage`).
        stage = bool(self.spare_bytes) and self.planner.should_stage(key)
        still_wanted = (lambda: wanted(key)) if wanted else None
        return self.moves.prefetch_load(key, stage=stage, still_wanted=still_wanted)

    def _in_ram(self, key: ExpertKey) -> bool:
        """Whether a prefetch of `key` has nothing to do (CUDA: staged copies come from tier 2)."""
        return key in self.fast or (not self.cuda and key in self.host)

    def _prefetch_next(self, layer: int, hidden: torch.Tensor) -> None:
        """Pre-gate and issue loads for the next `prefetch_depth` MoE layers, nearest first."""
        if self.prefetcher is None:
            return
        # Staged decoded experts must fit the spare buffer (`_staging_slot`: the largest expert's
        # tier-1 bytes, taken once: a max over every expert here cost Qwen3-30B ~2 ms a token);
        # tier-2-only prefetch is cheap.
        slot = self._staging_slot
        self.prefetcher.max_inflight = max(1, self.spare_bytes // slot) if self.spare_bytes else 8
        ahead = self.ahead_routers.choose(layer, hidden) if self.ahead_routers is not None else None
        predicting = 0.0  # the "predict" phase, timed without a context manager per layer ahead
        nexts = self._ahead[layer]
        for d, nxt in enumerate(nexts):
            t0 = time.perf_counter()
            pred = self.prefetcher.predict(
                nxt,
                hidden,
                self.routers.get(nxt),
                self.top_k[nxt],
                self.routing.by_layer[nxt],
                score=d == 0,
                pregated=ahead[d] if ahead is not None else None,
            )
            predicting += time.perf_counter() - t0
            self.planner.expect(nxt, pred)
            self.prefetcher.issue(nxt, pred, skip=self._in_ram)
        if nexts:
            self.phases.add("predict", predicting, len(nexts))

    def keys(self) -> list[ExpertKey]:
        """Every ``(layer, expert)`` the file holds, in memory or not, sorted."""
        return self.ftw.expert_keys()

    def weights_file(self) -> tuple[Path, int] | None:
        return Path(self.ftw.path), self.ftw.fileno()

    # ---- a warm start from a recorded routing ----------------------------------------------
    def warm_start(self, steps: Iterable[Step], *, progress: bool = False) -> int:
        """Start from a recorded routing of this model (`routing_trace.iter_steps` of a trace
        written by `record_routing`, streamed) instead of a cold tier 1: q*'s routing frequencies are seeded
        as if the engine had run those steps, tier 1 is filled with the most used experts that
        fit (read from tier 3 if tier 2 lacks them) and its hot set pinned. What llama.cpp's
        `-ot` asks a user to do by hand, from the same information; q* goes on adapting from
        there. Returns how many experts it brought into tier 1. RoutingTraceError (one line) for
        a step naming a layer or expert the model lacks; EngineError with placement "stream"
        (the per-layer LRU baseline keeps no frequencies)."""
        if not self.exclusive:
            raise EngineError("a routing profile warm-starts placement 'qstar' only, not 'stream'")
        name = Path(self.ftw.path).name
        keys = self.planner.warm_start(tqdm(steps, desc=f"profile {name}", unit="step", disable=not progress))
        self._promote_all(keys, f"warm {name}", progress)
        self.planner.refresh_hot()
        logger.info("warm start: %d experts in tier 1 from the routing profile", len(keys))
        return len(keys)

    def fill_fast(self, *, progress: bool = False) -> int:
        """Fill tier 1's free room now, before any routing is seen (`ExpertPlanner.load_fill`:
        an even share of every layer), as llama.cpp fills the GPU's layers at load: the first
        tokens then run from it instead of waiting for copies. q* replaces these experts as the
        routing shows what is used. Placement "stream" (the per-layer LRU baseline) starts
        empty. Returns how many experts it brought into tier 1."""
        if not self.exclusive:
            return 0
        keys = self.planner.load_fill()
        self._promote_all(keys, f"fill {Path(self.ftw.path).name}", progress)
        logger.info("tier 1 filled at load: %d experts", len(keys))
        return len(keys)

    def _promote_all(self, keys: list[ExpertKey], desc: str, progress: bool) -> None:
        """Bring `keys` into tier 1 in order (read from tier 3 where tier 2 lacks them)."""
        for key in tqdm(keys, desc=desc, unit="expert", disable=not progress):
            self.moves.promote(key, None)

    # ---- anchors: expert-cache state ------------------------------------------------------
    def snapshot_state(self) -> dict[str, list[ExpertKey]]:
        """Tier name -> experts held there, coldest first (an anchor records it with its KV)."""
        with self._lock:
            return {"fast": self.fast.keys(), "host": self.host.keys()}

    def restore_state(self, state: Mapping[str, Sequence[ExpertKey]]) -> None:
        """Re-warm tier 1 after a rollback: the anchor's tier-1 experts become the most recently
        used again (the tokens after the anchor route like the ones before it). Those that left
        tier 1 but are still in tier 2 are promoted; those that left RAM are not read back: a
        rollback never waits on the disk, and a demand read brings them in if they are needed."""
        for key in state.get("fast", ()):  # coldest first, so the hottest ends up most recent
            key = (int(key[0]), int(key[1]))
            with self._lock:
                if key in self.fast:
                    self.fast.get(key, count=False)
                    continue
                if key not in self.host:
                    continue
            self.moves.promote(key, None)

    # ---- observability --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Hits/misses per tier, bytes moved per link, bandwidth estimates (and their recent
        history), decisions, prefetch precision/recall, time per phase (s), budget figures
        (bytes). JSON-able: each part's own `stats()`, composed."""
        storage = self.reader.stats()
        links = (self.storage_link, self.fast_link, self.act_link)
        return {
            "tiers": {"fast": self.fast.stats(), "host": self.host.stats(), "storage": storage},
            "exclusive_ram_tiers": self.exclusive,
            "bytes_moved": self.moves.stats(),
            "file_bytes_read": storage["bytes_read"],
            "bandwidth": {link.name: link.stats() for link in links if link},
            "policy": self.policy.stats(),
            "prefetch": self.prefetcher.stats() if self.prefetcher else None,
            **self.phases.stats(),
            "budget": {
                "fast_bytes": self.budget.fast_bytes,
                "host_bytes": self.budget.host_bytes,
                "kv_bytes": self.kv_bytes,
                "spare_bytes": self.spare_bytes,
                "min_working_set": self.min_working_set,
            },
            "steps": self.planner.steps,
            "graph_steps": self.graph_steps.stats() if self.graph_steps is not None else None,
        }

    def close(self) -> None:
        """Stop the loader threads, remove the attention hooks, close the tier-3 reader."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.reader.close()
