"""TieredExpertProvider: the ExpertProvider over an FTW file and a MemoryBudget.

Tiers (CPU-only machine): tier 1 = decoded, packed `ExpertWeights` ready for matmul; tier 2 =
the stored (verified) FTW block bytes in RAM, one LRU for all layers; tier 3 = the FTW file.
On CUDA: tier 1 = device tensors, tier 2 = decoded experts in pinned host memory.

Placements (chosen per expert per step by `QStarPolicy`):
- RESIDENT: in tier 1; compute there.
- STREAM: bring it to tier 1 (tier 3 -> 2 if needed, then decode / copy), keep it there (LRU,
  may evict), compute there. On CUDA the copy is `non_blocking` on a side stream from pinned
  memory, timed by events; compute waits on the copy's event.
- HOST: CPU-only: decode the tier-2 bytes (read from tier 3 into tier 2 first if absent) into a
  transient buffer (zero-copy views when the stored codec is the compute dtype) and compute from
  it; nothing enters tier 1 and nothing is evicted. CUDA: compute on the CPU with the pinned
  tier-2 weights; only the expert's activations cross the link.

Prefetch target: on CUDA the spare half of a double buffer in tier 1 (side-stream copies the
compute stream waits for by event); on a CPU-only machine tier 2 only (read-ahead from the file),
since HOST computes straight from the stored bytes and staged decoded copies would take tier-1 room.
`placement="stream"` turns this provider into the per-layer-LRU baseline (`LayerLRUTier` +
`AlwaysStreamPolicy`).

Every placement computes `expert_forward` on identical weight values, in the summation order of
`run_experts`, so the logits equal the all-in-RAM engine's whatever the budget.

Fast memory is shared with the KV cache: `attach(engine)` installs `on_kv_resize` as the
BlockPool's `on_resize`; KV growth shrinks the expert tier (prefetch staging first, then coldest
experts, pinned last), freed KV regrows it. MemoryBudgetError when even one layer's top_k
experts cannot fit (at construction, or when KV would take that room; the block is refused).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import MemoryBudgetError
from ..experts import ExpertKey, ExpertWeights, expert_forward
from ..ftw import FTWFile
from ..ftw.provider import canonical_expert
from ..spec import MoESpec
from .budget import MemoryBudget
from .oracle import BandwidthOracle, Clock, cuda_timed_copy
from .policy import AlwaysStreamPolicy, ComputeCostModel, ExpertCase, Placement, QStarPolicy
from .prefetch import Prefetcher
from .tiers import FastTier, HostTier, LayerLRUTier
from .weights import codec_name, decoded_bytes, pinned_storage, rebase

if TYPE_CHECKING:
    from ..engine import Engine

logger = logging.getLogger(__name__)


class TieredExpertProvider:
    """Experts from `ftw` under `budget` (fast_bytes: tier 1 + KV; host_bytes: tier 2).

    Args:
        top_k: experts per token (int, or per MoE layer); sets the minimum working set.
        dtype: compute dtype of decoded experts. device: "cpu" or "cuda[:N]".
        prefetch: pre-gating prefetch on (needs `attach` for the routers); `prefetch_thread`
            False loads inline (deterministic tests).
        hot_every: re-evaluate the pinned hot set every this many steps; `decay`: per-step decay
            of routing frequencies.
        placement: "qstar" (cost model, shared fast LRU + pinned hot set) or "stream" (baseline:
            always stream into a per-layer LRU, no hot set; mixtral-offloading's design).
    Raises MemoryBudgetError if fast_bytes cannot hold one layer's top_k largest experts.
    """

    def __init__(
        self,
        ftw: FTWFile | str | os.PathLike[str],
        budget: MemoryBudget,
        *,
        top_k: int | Mapping[int, int],
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        prefetch: bool = True,
        prefetch_thread: bool = True,
        policy: QStarPolicy | None = None,
        clock: Clock = time.monotonic,
        hot_every: int = 16,
        decay: float = 0.9,
        max_pinned_fraction: float = 0.5,
        placement: str = "qstar",
    ) -> None:
        self.ftw = ftw if isinstance(ftw, FTWFile) else FTWFile(Path(ftw))
        self.budget, self.dtype, self.device = budget, dtype, torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.clock, self.hot_every, self.decay = clock, hot_every, decay
        keys = self.ftw.expert_keys()
        elem = torch.empty((), dtype=dtype).element_size()
        self.stored_bytes = {k: self.ftw.expert_info(*k).stored_length for k in keys}
        self.fast_bytes = {k: decoded_bytes(self.ftw, k, elem) for k in keys}
        self.codec = {k: codec_name(self.ftw, k) for k in keys}
        layers = sorted({k[0] for k in keys})
        self.layers = layers
        self.top_k = {lay: top_k if isinstance(top_k, int) else top_k[lay] for lay in layers}
        self.min_working_set = max(
            sum(sorted((self.fast_bytes[k] for k in keys if k[0] == lay), reverse=True)[: self.top_k[lay]])
            for lay in layers
        )
        self.kv_bytes = 0
        self.spare_bytes = 0
        if placement not in ("qstar", "stream"):
            raise ValueError(f"placement must be 'qstar' or 'stream', got {placement!r}")
        self.placement = placement
        if placement == "stream":
            self.fast: FastTier[ExpertWeights] = LayerLRUTier(None, len(layers))
            # every layer needs its own top-k working set
            self.min_working_set = len(layers) * self.min_working_set
        else:
            self.fast = FastTier[ExpertWeights](None, max_pinned_fraction=max_pinned_fraction)
        self.host = HostTier[Any](budget.host_bytes)
        self._prefetch_wanted = prefetch
        self._apply_fast_budget()
        self.storage_link = BandwidthOracle("storage->host", clock=clock, prior_bps=1e9)
        self.fast_link = BandwidthOracle("host->fast", clock=clock, prior_bps=1e10)
        self.act_link = BandwidthOracle("activations", clock=clock, prior_bps=1e10) if self.cuda else None
        policy_cls = AlwaysStreamPolicy if placement == "stream" else QStarPolicy
        self.policy = policy or policy_cls(
            self.storage_link, self.fast_link, self.act_link, ComputeCostModel(),
            fast_device=self.device.type, host_device="cpu-host",
        )
        self.prefetcher = Prefetcher(self._prefetch_load, use_thread=prefetch_thread) if prefetch else None
        self.routers: dict[int, torch.nn.Module] = {}
        self.freq: dict[int, dict[int, float]] = {lay: {} for lay in layers}
        self.steps = 0
        self.phase_s = {"experts": 0.0, "demand_load": 0.0, "predict": 0.0}
        self.bytes_moved = {"storage->host": 0, "host->fast": 0}
        self._lock = threading.RLock()
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pending_compute: list[tuple[Any, Any, int]] = []

    # ---- budget ---------------------------------------------------------------------------
    def _apply_fast_budget(self) -> None:
        total = self.budget.fast_bytes
        if total is None:
            self.spare_bytes = self.min_working_set if self._prefetch_wanted and self.cuda else 0
            self.fast.resize(None)
            return
        avail = total - self.kv_bytes
        if avail < self.min_working_set:
            raise MemoryBudgetError(
                f"fast memory budget of {total} bytes cannot hold the KV cache ({self.kv_bytes} "
                f"bytes) plus the minimum expert working set ({self.min_working_set} bytes: one "
                f"layer's top-k experts); raise MemoryBudget.fast_bytes or shorten the context"
            )
        # Prefetch staging (the spare half of the double buffer) goes first under pressure. On a
        # CPU-only machine prefetch reads ahead into tier 2 only: HOST computes straight from the
        # stored bytes, so decoded staging copies would only take room from tier 1 (measured:
        # with staging, tier-1 hit rate 0.63 -> 0.21 and decode 26 -> 9 tok/s, bench/offload.py).
        wanted = self.min_working_set if self._prefetch_wanted and self.cuda else 0
        self.spare_bytes = wanted if avail - wanted >= self.min_working_set else 0
        evicted = self.fast.resize(avail - self.spare_bytes)
        if evicted:
            logger.debug("fast tier shrank to %d bytes: evicted %s", avail - self.spare_bytes, evicted)

    def on_kv_resize(self, kv_bytes: int) -> None:
        """BlockPool.on_resize: KV now needs `kv_bytes` of fast memory; resize the expert tier."""
        old = self.kv_bytes
        self.kv_bytes = kv_bytes
        try:
            self._apply_fast_budget()
        except MemoryBudgetError:
            self.kv_bytes = old
            raise

    # ---- wiring ---------------------------------------------------------------------------
    @classmethod
    def for_engine(cls, engine: Engine, ftw: FTWFile | str | os.PathLike[str], budget: MemoryBudget,
                   **kwargs: Any) -> TieredExpertProvider:
        """Build for `engine`'s spec (top_k per MoE layer) and `attach` it."""
        top_k = {i: engine.spec.layers[i].moe.top_k for i in engine.spec.moe_layers()}  # type: ignore[union-attr]
        provider = cls(ftw, budget, top_k=top_k, dtype=engine.dtype, device=str(engine.device), **kwargs)
        provider.attach(engine)
        return provider

    def attach(self, engine: Engine) -> None:
        """Take the routers (pre-gating), share fast memory with the KV pool, become the provider."""
        from ..moe import MoEBlock

        for i, layer in enumerate(engine.model.layers):
            if isinstance(layer.mlp, MoEBlock):
                self.routers[i] = layer.mlp.router
        self.on_kv_resize(engine.kv_pool.blocks_in_use * engine.kv_pool.bytes_per_block)
        engine.kv_pool.on_resize = self.on_kv_resize
        engine.use_expert_provider(self)

    # ---- loading --------------------------------------------------------------------------
    def _host_value(self, key: ExpertKey) -> Any:
        """Tier-2 value of `key` (CPU: stored bytes; CUDA: pinned decoded expert), read from the
        file on a miss. Thread-safe. FTWFormatError for a corrupted block."""
        with self._lock:
            value = self.host.get(key)
        if value is not None:
            return value
        n = self.stored_bytes[key]
        with self.storage_link.time_transfer(n):
            value = self.ftw.read_expert_bytes(*key)
        if self.cuda:  # tier 2 on CUDA: decoded, packed into pinned (page-locked) host memory
            value = self._decode(key, value, pack=False)
            value = rebase(value, pinned_storage(value, self.dtype))
        with self._lock:
            self.bytes_moved["storage->host"] += n
            self.host.put(key, value, n if not self.cuda else self.fast_bytes[key])
        return value

    def _decode(self, key: ExpertKey, stored: Any, *, pack: bool) -> ExpertWeights:
        decoded = self.ftw.decode_stored(key[0], key[1], stored, self.dtype, verify=False)
        tensors = canonical_expert(decoded, path=self.ftw.path, key=key)
        return ExpertWeights.packed(tensors, self.dtype) if pack else ExpertWeights(**tensors)

    def _to_fast(self, key: ExpertKey, host_value: Any) -> ExpertWeights:
        """Tier-2 value -> tier-1 weights (CPU: decode + pack; CUDA: async copy on the side
        stream, which the compute stream waits for)."""
        if not self.cuda:
            n = self.stored_bytes[key]
            with self.fast_link.time_transfer(n):
                w = self._decode(key, host_value, pack=True)
            with self._lock:  # also called from the loader thread
                self.bytes_moved["host->fast"] += n
            return w
        w, done = self._start_copy(key, host_value)
        return self._ready_on_compute_stream(w, done)

    def _start_copy(self, key: ExpertKey, host_value: ExpertWeights) -> tuple[ExpertWeights, Any]:
        """CUDA: start the pinned-host -> device copy of `key` on the side stream; returns the
        device weights (not yet safe to read) and the copy's end event. The device buffer is
        allocated on the side stream, so the caching allocator orders its reuse after the copy."""
        src = host_value.storage
        assert src is not None and self._copy_stream is not None
        with torch.cuda.stream(self._copy_stream):
            dst = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        done = cuda_timed_copy(self.fast_link, dst, src, self._copy_stream)
        with self._lock:
            self.bytes_moved["host->fast"] += src.numel() * src.element_size()
        return rebase(host_value, dst), done

    def _ready_on_compute_stream(self, w: ExpertWeights, done: Any) -> ExpertWeights:
        """Make the current (compute) stream wait for the copy event, and tell the allocator the
        side-stream buffer is used there (`record_stream`) so it is not freed early."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(done)
        assert w.storage is not None
        w.storage.record_stream(stream)
        return w

    def _prefetch_load(self, key: ExpertKey) -> tuple[ExpertWeights, Any] | None:
        """Loader-thread job: into tier 2; on CUDA also start the copy into the spare buffer (the
        consumer waits on the returned event). CPU: tier 2 only (see `_apply_fast_budget`)."""
        value = self._host_value(key)
        if self.cuda and self.spare_bytes:
            return self._start_copy(key, value)
        return None

    # ---- the ExpertProvider protocol ------------------------------------------------------
    def get(self, layer: int, expert: int) -> ExpertWeights:
        """The expert's weights on the compute device (promotes it to tier 1 when it fits)."""
        key = (layer, expert)
        w = self.fast.get(key)
        if w is None:
            w = self._to_fast(key, self._host_value(key))
            self.fast.put(key, w, self.fast_bytes[key])
        return w

    def run(
        self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, spec: MoESpec
    ) -> torch.Tensor:
        """hidden [T, H], expert_ids [T, A], weights [T, A] -> [T, H] (same order as run_experts)."""
        t_start = time.perf_counter()
        if self._pending_compute:
            self._poll_compute()
        used = sorted(set(expert_ids.reshape(-1).tolist()))
        self._note_routing(layer, used)
        if self.prefetcher is not None:
            self.prefetcher.begin_layer(layer, used)
            self._prefetch_next(layer, hidden)
        out = torch.zeros_like(hidden)
        if hidden.shape[0] == 1:
            ids = expert_ids[0].tolist()
            for a in sorted(range(len(ids)), key=ids.__getitem__):
                y = self._compute(layer, ids[a], hidden, spec)
                out += (y * weights[0, a]).to(out.dtype)
        else:
            flat_ids = expert_ids.reshape(-1)
            order = torch.argsort(flat_ids, stable=True)
            token_of = order // expert_ids.shape[1]
            experts, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
            start = 0
            for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
                idx = order[start : start + count]
                # clone(): index_add_ with an index that is a view into a larger tensor is ~300x
                # slower on CPU (torch 2.13; see experts.run_experts).
                tokens = token_of[start : start + count].clone()
                start += count
                y = self._compute(layer, expert, hidden[tokens], spec)
                w = weights.reshape(-1)[idx, None]
                out.index_add_(0, tokens, (y * w).to(out.dtype))
        self.phase_s["experts"] += time.perf_counter() - t_start
        return out

    def _compute(self, layer: int, expert: int, x: torch.Tensor, spec: MoESpec) -> torch.Tensor:
        key = (layer, expert)
        t = x.shape[0]
        w = self.fast.get(key)
        staged = None
        if w is None and self.prefetcher is not None:
            staged = self.prefetcher.take(key)
        with self._lock:
            in_host = key in self.host
            hc = self.host.counters
            host_miss = hc.misses / (hc.hits + hc.misses) if hc.hits + hc.misses else 1.0
        case = ExpertCase(
            tokens=t, codec=self.codec[key], resident=w is not None, in_host=in_host or staged is not None,
            stored_bytes=self.stored_bytes[key], fast_bytes=self.fast_bytes[key],
            activation_bytes=2 * x.numel() * x.element_size(),
            prefetched_s=float("inf") if staged is not None else 0.0,
            frequency=self.freq[layer].get(expert, 0.0),
            victims=[(self._reload_s(v, host_miss), self.freq[v[0]].get(v[1], 0.0))
                     for v in self.fast.victims_for(self.fast_bytes[key], key)],
            host_miss=host_miss,
            can_stream=self.fast.fits(self.fast_bytes[key], key),
            free_room=self.fast.has_room(self.fast_bytes[key], key),
        )
        place = self.policy.decide(key, case)
        t0 = time.perf_counter()
        if place is Placement.HOST:
            host_value = self._host_value(key)
            hw = host_value if self.cuda else self._decode(key, host_value, pack=False)
            if self.cuda:  # compute where the weights are; move only activations
                y = expert_forward(hw, x.to("cpu"), spec).to(self.device, non_blocking=True)
            else:
                y = expert_forward(hw, x, spec)
            self.policy.compute.observe("cpu-host", self.codec[key], t, time.perf_counter() - t0)
            return y
        if w is None:
            if staged is not None:
                w = self._ready_on_compute_stream(*staged)
            else:
                w = self._to_fast(key, self._host_value(key))
            self.fast.put(key, w, self.fast_bytes[key])
            self.phase_s["demand_load"] += time.perf_counter() - t0
            t0 = time.perf_counter()
        if not self.cuda:
            y = expert_forward(w, x, spec)
            self.policy.compute.observe(self.device.type, "decoded", t, time.perf_counter() - t0)
            return y
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y = expert_forward(w, x, spec)
        end.record()
        self._pending_compute.append((start, end, t))  # folded in by _poll_compute, no sync
        return y

    def _poll_compute(self) -> None:
        """CUDA: fold finished compute timings (events) into the cost model."""
        still = []
        for start, end, t in self._pending_compute:
            if end.query():
                self.policy.compute.observe(self.device.type, "decoded", t, start.elapsed_time(end) / 1e3)
            else:
                still.append((start, end, t))
        self._pending_compute = still

    def _reload_s(self, key: ExpertKey, host_miss: float) -> float:
        """Predicted seconds to bring `key` back into tier 1 after an eviction."""
        n = self.stored_bytes[key]
        return self.fast_link.seconds_for(n) + host_miss * self.storage_link.seconds_for(n)

    # ---- routing statistics, hot set, prefetch --------------------------------------------
    def _note_routing(self, layer: int, used: list[int]) -> None:
        f = self.freq[layer]
        for e in list(f):
            f[e] *= self.decay
        for e in used:
            f[e] = f.get(e, 0.0) + 1.0
        if layer == self.layers[0]:
            self.steps += 1
            if self.steps % self.hot_every == 0:
                ranked = sorted(((v, (lay, e)) for lay, fl in self.freq.items() for e, v in fl.items()),
                                reverse=True)
                self.fast.set_hot([k for _, k in ranked])

    def _prefetch_next(self, layer: int, hidden: torch.Tensor) -> None:
        pos = self.layers.index(layer)
        if pos + 1 >= len(self.layers) or self.prefetcher is None:
            return
        nxt = self.layers[pos + 1]
        # Staged decoded experts must fit the spare buffer; tier-2-only prefetch is cheap.
        biggest = max(self.fast_bytes.values())
        self.prefetcher.max_inflight = max(1, self.spare_bytes // biggest) if self.spare_bytes else 8
        t0 = time.perf_counter()
        pred = self.prefetcher.predict(nxt, hidden, self.routers.get(nxt), self.top_k[nxt], self.freq[nxt])
        self.phase_s["predict"] += time.perf_counter() - t0
        self.prefetcher.issue(nxt, pred, skip=lambda k: k in self.fast)

    # ---- observability --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Hits/misses per tier, bytes moved per link, bandwidth estimates, decisions, prefetch
        precision/recall, time per phase (s), budget figures (bytes). JSON-able."""
        return {
            "tiers": {"fast": self.fast.stats(), "host": self.host.stats()},
            "bytes_moved": dict(self.bytes_moved),
            "file_bytes_read": self.ftw.bytes_read,
            "bandwidth": {o.name: o.stats() for o in (self.storage_link, self.fast_link, self.act_link) if o},
            "policy": self.policy.stats(),
            "prefetch": self.prefetcher.counters.as_dict() if self.prefetcher else None,
            "phase_s": dict(self.phase_s),
            "budget": {"fast_bytes": self.budget.fast_bytes, "host_bytes": self.budget.host_bytes,
                       "kv_bytes": self.kv_bytes, "spare_bytes": self.spare_bytes,
                       "min_working_set": self.min_working_set},
            "steps": self.steps,
        }

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()

