"""`TierMover`: moves expert blocks between the tiers and counts the bytes on each link.

- tier 3 -> tier 2 (`read_block`, `host_value`): `BlockReader` reads a verified block past the
  page cache; on CUDA its raw (compact: fp8, int8, MXFP4 as stored) bytes are copied into one
  pinned host buffer (`weights.pinned_raw`), so tier 2 holds as many experts as their stored
  size allows (~4x more MXFP4 than bf16 experts in the same RAM).
- tier 2 -> tier 1 (`promote`): CPU: decode the stored bytes. With exclusive tiers and a block
  that decodes zero-copy (stored codec = compute dtype) the bytes *move*: the tier-1 weights are
  views of the tier-2 buffer, which leaves tier 2 (no copy, no second copy in RAM). Otherwise
  tier 1 gets a decoded copy and the compact bytes stay in tier 2 (the baseline design always
  copies: `ExpertWeights.packed`). CUDA: the compact bytes cross the link (a non_blocking copy
  on a side stream) and the GPU decodes them (`FTWFile.decode_raw`, event-timed for q*).
- tier 1 -> tier 2 (`demote`, tier 1's `on_evict`): an evicted zero-copy block returns to tier 2
  (it is already in RAM); one tier 2 cannot take leaves RAM and its buffer is recycled. CUDA with
  exclusive tiers (`spill`, tier 1's `on_evict` there): an expert whose decoded form is no
  larger than its compact one (bf16 stored, bf16 compute) moves up and, evicted, is copied back
  into pinned memory (a device -> host copy, ~1 ms for 25 MB, instead of a disk read); a compact
  expert keeps its bytes in tier 2 and its decoded copy is simply dropped.
Thread-safe: the loader threads read and insert into tier 2 under `lock` while the compute thread
promotes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, cast

import torch

from ..ftw import FTWFile
from ..kernels.int8 import ExpertQuant
from ..model.expert_tensors import WEIGHT_NAMES, kept_forms
from ..model.experts import ExpertKey, ExpertWeights
from ..model.grouped_experts import StackCodec
from .fast_tier import FastTier, LayerLRUTier
from .oracle import BandwidthOracle
from .prefetch import SKIPPED
from .slot_pool import TierSlots
from .stats import PhaseTimer
from .storage import BlockReader
from .tiers import HostTier
from .weights import codec_name, decode_block, decode_raw, pinned_raw, pinned_storage, rebase


class TierMover:
    """Block movement between tier 1 (`fast`), tier 2 (`host`) and the file read by `reader`.

    The mover builds both tiers, so their eviction hooks are its own methods from the start:
    `placement` "qstar" gives tier 1 a pinned hot set (`FastTier`), "stream" one LRU per layer
    (`LayerLRUTier`, `n_layers`); both start unbounded (the provider sizes tier 1 against the KV
    cache). Tier 2 holds `host_bytes`; `rank` orders its evictions; `protected` names keys both
    tiers evict last (needed soon).
    `exclusive`: tier 1 and tier 2 never both hold an expert (q* placement; CPU: zero-copy blocks
    move up, others keep their compact bytes in tier 2; CUDA: experts that do not grow when
    decoded move, compact ones keep their bytes in tier 2).
    `backing`: tier-1 key -> (the stored bytes its weights are views of, those views as they
    entered tier 1). `timer`: CUDA, times the
    device decodes for q* (`ComputeTimer`, kind "decode/<codec>"); `codecs`: key -> codec name.
    `expert_quant`: what HOST compute keeps compact; `tier1_quant` (default the same): what tier 1
    keeps compact (on CUDA "none" unless "compact": the device decode then leaves the arrived
    bytes as they are). `slots`: tier 1 keeps its experts in one slot pool
    (`slot_pool.TierSlots`): a promotion copies the expert into a slot (on a CPU the stored bytes
    then stay in tier 2 instead of moving up), an eviction frees the slot.
    """

    def __init__(
        self,
        ftw: FTWFile,
        dtype: torch.dtype,
        device: torch.device,
        reader: BlockReader,
        links: tuple[BandwidthOracle, BandwidthOracle],
        phases: PhaseTimer,
        *,
        cuda: bool,
        exclusive: bool,
        stored_bytes: dict[ExpertKey, int],
        fast_bytes: dict[ExpertKey, int],
        placement: str = "qstar",
        n_layers: int = 1,
        host_bytes: int | None = None,
        max_pinned_fraction: float = 0.5,
        rank: Callable[[Any], float] | None = None,
        protected: Callable[[Any], bool] | None = None,
        timer: Any = None,
        codecs: dict[ExpertKey, str] | None = None,
        expert_quant: ExpertQuant = "none",
        tier1_quant: str | None = None,
        slots: bool = False,
    ) -> None:
        self.ftw, self.dtype, self.reader = ftw, dtype, reader
        self.storage_link, self.fast_link = links
        self.phases, self.cuda, self.exclusive = phases, cuda, exclusive
        self.stored_bytes, self.fast_bytes = stored_bytes, fast_bytes
        self.lock = threading.RLock()
        self.backing: dict[ExpertKey, tuple[Any, ExpertWeights]] = {}
        self.timer, self.expert_quant = timer, expert_quant
        # What tier 1 keeps compact (CUDA: what the device decode leaves as it arrived).
        self.tier1_quant = expert_quant if tier1_quant is None else tier1_quant
        self.codecs = codecs if codecs is not None else {k: codec_name(ftw, k) for k in stored_bytes}
        self.raw_bytes = {k: ftw.expert_info(*k).raw_length for k in stored_bytes}
        # CUDA, exclusive: the experts that leave tier 2 when promoted (spilled back on eviction):
        # those decoded to a float form no larger than their raw bytes (bf16 stored, bf16
        # compute). Ones tier 1 keeps compact keep their bytes in tier 2 instead.
        self.moves_up = {
            k
            for k in stored_bytes
            if exclusive and fast_bytes[k] <= self.raw_bytes[k] and not self._kept_compact(k)
        }
        self.bytes_moved = {"storage->host": 0, "host->fast": 0, "fast->host": 0}
        self.last_put_s = 0.0  # CUDA: seconds the last promotion's tier-1 put and slot copy took
        self.copies: Any = None
        if cuda:
            from .cuda_path import CopyEngine

            self.copies = CopyEngine(device, self.fast_link)
        # CPU: tier-2 values are the reader's buffers, reused once dropped; an expert leaving
        # tier 1 is demoted. CUDA with exclusive tiers: it is spilled back into pinned tier 2.
        on_host_evict = None if cuda else self._retire_host
        # CPU: tier-2 values whose decode is zero-copy (fp32 stored for fp32 compute, int8 kept
        # int8), with the weights last decoded from them: a HOST computation or a promotion of
        # the same value does not parse and validate its block again (~50 us an expert here).
        self._host_weights: dict[ExpertKey, tuple[Any, ExpertWeights]] = {}
        on_fast_evict = (self.spill if exclusive else None) if cuda else self.demote
        # Tier 1's experts in one slot pool (the grouped, graph-capturable decode step).
        self.slots: TierSlots | None = None
        # With slots: the codec of the pool's layout when it can hold every expert of the file
        # (one stored layout, both projections kept in one form), else None.
        self.tier1_codec: StackCodec | None = None
        if slots and stored_bytes:
            layers, experts = (max(k[i] for k in stored_bytes) + 1 for i in (0, 1))
            self.slots = TierSlots(layers, experts, len(stored_bytes), device)
            on_fast_evict = self._releasing_slot(on_fast_evict)
            stored = {
                tuple(sorted((n, t.shape, t.codec) for n, t in ftw.expert_info(*k).tensors.items()))
                for k in stored_bytes
            }
            if len(stored) == 1:
                self.tier1_codec = self._tier1_form(next(iter(stored_bytes)))
        if placement == "stream":
            self.fast: FastTier[ExpertWeights] = LayerLRUTier(
                None, n_layers, on_evict=on_fast_evict, protected=protected
            )
        else:
            self.fast = FastTier(
                None, max_pinned_fraction=max_pinned_fraction, on_evict=on_fast_evict, protected=protected
            )
        self.host: HostTier[Any] = HostTier(
            host_bytes, on_evict=on_host_evict, rank=rank, protected=protected
        )

    def _releasing_slot(
        self, hook: Callable[[ExpertKey, ExpertWeights], None] | None
    ) -> Callable[[ExpertKey, ExpertWeights], None]:
        """Tier 1's eviction hook with slots: `hook` (which may still read the weights: `spill`
        copies them back), then the slot is freed."""

        def on_evict(key: ExpertKey, w: ExpertWeights) -> None:
            if hook is not None:
                hook(key, w)
            assert self.slots is not None
            self.slots.release(key)

        return on_evict

    def _into_slot(self, key: ExpertKey, w: ExpertWeights) -> ExpertWeights | None:
        """With slots: copy `key`, just put in tier 1, into a slot and hold the slot's views
        instead (None: not in tier 1, or not of the pool's layout). Under `lock`."""
        if self.slots is None or key not in self.fast:
            return None
        epoch = self.slots.epoch
        view = self.slots.assign(key, w, self.fast.capacity_bytes, self.fast_bytes[key])
        if view is None:
            return None
        self.fast.replace(key, view)
        if self.slots.epoch != epoch:
            self._repoint()
        return view

    def _repoint(self) -> None:
        """The pool moved: tier 1 holds the new buffer's views."""
        assert self.slots is not None
        for key, view in self.slots.views().items():
            self.fast.replace(key, view)

    def fit_slots(self) -> None:
        """Size the slot pool to tier 1's capacity (after `fast.resize`; under `lock`)."""
        if self.slots is not None:
            epoch = self.slots.epoch
            self.slots.fit(self.fast.capacity_bytes)
            if self.slots.epoch != epoch:
                self._repoint()

    def stats(self) -> dict[str, int]:
        """Bytes moved per link ("storage->host", "host->fast", "fast->host")."""
        return dict(self.bytes_moved)

    def _kept_compact(self, key: ExpertKey) -> bool:
        tensors = self.ftw.expert_info(*key).tensors
        return bool(kept_forms({n: t.codec for n, t in tensors.items()}, self.tier1_quant))

    def _tier1_form(self, key: ExpertKey) -> StackCodec | None:
        """How tier 1 holds `key`'s projections: "float" (decoded), "int8" or "mxfp4" (kept
        compact), None when they differ (a mixed expert, which no slot pool holds)."""
        tensors = self.ftw.expert_info(*key).tensors
        kept = kept_forms({n: t.codec for n, t in tensors.items()}, self.tier1_quant)
        forms = {kept.get(n, "float") for n in tensors if n in WEIGHT_NAMES}
        return cast(StackCodec, forms.pop()) if len(forms) == 1 else None

    def read_block(
        self, key: ExpertKey, *, urgent: bool = True, still_wanted: Callable[[], bool] | None = None
    ) -> Any:
        """Tier 3 -> a tier-2 value (CPU: verified stored bytes; CUDA: the raw compact bytes in
        pinned memory). FTWFormatError for a corrupted or truncated block (the checksum is
        checked before anything is kept). Inserts nothing. `urgent`: a demand read, served
        before queued prefetch reads. None if `still_wanted` said no (prefetch)."""
        n = self.stored_bytes[key]
        value = self.reader.read(*key, urgent=urgent, still_wanted=still_wanted)  # timed: __init__
        if value is None:
            return None
        if self.cuda:  # tier 2 on CUDA: the compact bytes in pinned (page-locked) host memory
            pinned = pinned_raw(self.ftw.raw_bytes(*key, value))
            self.reader.buffers.retire(value)  # the read buffer is free once copied
            value = pinned
        with self.lock:
            self.bytes_moved["storage->host"] += n
        return value

    def host_nbytes(self, key: ExpertKey, value: Any = None) -> int:
        """Tier-2 size of `key` held as `value` (CUDA: compact raw bytes, or a spilled decoded
        expert)."""
        if not self.cuda:
            return self.stored_bytes[key]
        return self.fast_bytes[key] if isinstance(value, ExpertWeights) else self.raw_bytes[key]

    def link_bytes(self, key: ExpertKey) -> int:
        """Bytes a STREAM of `key` moves over the host -> fast link (what q* prices)."""
        return self.raw_bytes[key] if self.cuda else self.stored_bytes[key]

    def host_value(self, key: ExpertKey, *, keep: bool = True) -> Any:
        """Tier-2 value of `key` (a counted hit or miss), read from tier 3 on a miss and, with
        `keep`, inserted into tier 2 (evicting its coldest)."""
        with self.lock:
            value = self.host.get(key)
        if value is not None:
            return value
        with self.phases.time("wait_storage"):
            value = self.read_block(key)
        if keep:
            with self.lock:
                self.host.put(key, value, self.host_nbytes(key, value))
        return value

    def decode(self, key: ExpertKey, stored: Any) -> ExpertWeights:
        """A tier-2 value as weights where its bytes are (CUDA tier 2: pinned raw bytes or a
        spilled decoded expert; CPU: stored bytes), int8 projections kept per `expert_quant`
        (zero-copy views of the stored int8 parts; kept with the value while it is in tier 2)."""
        if isinstance(stored, ExpertWeights):
            return stored
        if isinstance(stored, torch.Tensor):
            return decode_raw(self.ftw, key, stored, self.dtype, self.expert_quant)
        cached = self._host_weights.get(key)
        if cached is not None and cached[0] is stored:
            return cached[1]
        w = decode_block(self.ftw, key, stored, self.dtype, self.expert_quant)
        with self.lock:
            if self.host.peek(key) is stored and shares_memory(w, stored):
                self._host_weights[key] = (stored, w)
        return w

    def _views_of(self, key: ExpertKey, w: ExpertWeights, stored: Any) -> bool:
        """Whether `w` is views into `stored`: known without looking when `decode` kept them as
        such (every decode of a tier-2 value after its first), else `shares_memory` (~2 us)."""
        cached = self._host_weights.get(key)
        if cached is not None and cached[0] is stored and cached[1] is w:
            return True
        return shares_memory(w, stored)

    def _retire_host(self, key: ExpertKey, value: Any) -> None:
        """CPU (tier 2's `on_evict`): the value left RAM; its read buffer may be reused once
        nothing refers to it (its decoded views included)."""
        self._host_weights.pop(key, None)
        self.reader.buffers.retire(value)

    def _device_decode(self, key: ExpertKey, arrived: Any) -> ExpertWeights:
        """CUDA: what a copy brought to the device -> tier-1 weights. Compact bytes are decoded
        on the compute stream, timed by events (q* adds the decode to a STREAM's price)."""
        if isinstance(arrived, ExpertWeights):
            return arrived
        if self.timer is None:
            return decode_raw(self.ftw, key, arrived, self.dtype, self.tier1_quant)
        start = self.timer.start()
        w = decode_raw(self.ftw, key, arrived, self.dtype, self.tier1_quant)
        self.timer.stop(start, 1, kind=f"decode/{self.codecs[key]}")
        return w

    def demote(self, key: ExpertKey, w: ExpertWeights) -> None:
        """CPU (`fast.on_evict`): a zero-copy block leaving tier 1 goes back to tier 2 (its bytes
        are in RAM); a decoded copy is simply dropped."""
        backed = self.backing.pop(key, None)
        if backed is None:
            return
        stored, views = backed
        self.host.put(key, stored, self.stored_bytes[key])
        if key not in self.host:  # tier 2 cannot take it: it leaves RAM
            self.reader.buffers.retire(stored)
        elif w is views:  # its views come back with it (not a slot's copy): no parse on the next use
            self._host_weights[key] = (stored, w)

    def spill(self, key: ExpertKey, w: ExpertWeights) -> None:
        """CUDA, exclusive tiers (`fast.on_evict`): an expert that moved up goes back to tier 2,
        copied into pinned memory (the copy is ordered after the compute that still reads `w`).
        A compact expert's bytes never left tier 2: its decoded copy is dropped."""
        if key not in self.moves_up:
            return
        pinned = pinned_storage(w, self.dtype)
        with self.lock:
            self.bytes_moved["fast->host"] += self.fast_bytes[key]
            self.host.put(key, rebase(w, pinned), self.fast_bytes[key])

    def promote(self, key: ExpertKey, staged: Any, *, recent: bool = False) -> ExpertWeights:
        """Bring `key` into tier 1 from a finished prefetch (`staged`), tier 2 or tier 3; `recent`
        (CUDA, a staged copy of a block that does not move up): into tier 1's recent segment."""
        if self.cuda:
            moves_up = key in self.moves_up
            if staged is not None:
                arrived = self.copies.ready(*staged)
            else:
                arrived = self.copies.ready(*self.copies.start(self.host_value(key, keep=not moves_up)))
            w = self._device_decode(key, arrived)
            with self.lock:
                self.bytes_moved["host->fast"] = self.copies.bytes_copied
                if moves_up:  # it moved up (the pinned buffer is reused once the copy ends)
                    self.host.pop(key)
                t0 = time.perf_counter()
                if recent:
                    self.fast.put_recent(key, w, self.fast_bytes[key])  # evictions: `spill`
                else:
                    self.fast.put(key, w, self.fast_bytes[key])  # evictions: `spill`
                w = self._into_slot(key, w) or w
                self.last_put_s = time.perf_counter() - t0  # what keeping a staged copy costs
            return w
        stored = staged if staged is not None else self.host_value(key, keep=not self.exclusive)
        n = self.stored_bytes[key]
        # Timed as the "decode" phase and, on the oracle's clock, as one transfer of the fast link
        # (not through their context managers: a few us less on every promotion).
        clock = self.fast_link.clock
        t0, start = time.perf_counter(), clock()
        w = self.decode(key, stored)
        if not self.exclusive:  # the mixtral-offloading design: tier 1 holds its own copy
            w = (
                ExpertWeights.packed_mixed(w.tensors())
                if w.is_quantized
                else ExpertWeights.packed(w.tensors(), self.dtype)
            )
        self.fast_link.record(n, clock() - start)
        self.phases.add("decode", time.perf_counter() - t0)
        # Into a slot, the bytes are copied: they stay in tier 2 (and views of them never reach
        # tier 1, whose copy tier 2 could otherwise recycle).
        slotted = self.slots is not None and self.slots.accepts(w)
        shares = self.exclusive and not slotted and self._views_of(key, w, stored)
        with self.lock:
            self.bytes_moved["host->fast"] += n
            if shares:
                self.host.pop(key)  # the bytes move up, they are not copied
                self._host_weights.pop(key, None)
                self.backing[key] = (stored, w)
            elif key not in self.host:  # a decoded copy: the compact bytes stay in tier 2
                self.host.put(key, stored, n)
            self.fast.put(key, w, self.fast_bytes[key])  # evictions: `demote`
            view = self._into_slot(key, w)
            if view is not None:
                w = view
            elif slotted and key in self.fast and shares_memory(w, stored):
                w = ExpertWeights.packed(w.tensors(), self.dtype)  # tier 1 never holds views of tier 2
                self.fast.replace(key, w)
        return w

    def use_staged(self, key: ExpertKey, staged: Any) -> ExpertWeights:
        """CUDA: the weights of a prefetch's staged copy, for one computation (not kept in tier 1:
        q*'s STAGED placement, which evicts nothing)."""
        return self._device_decode(key, self.copies.ready(*staged))

    def prefetch_load(
        self, key: ExpertKey, *, stage: bool, still_wanted: Callable[[], bool] | None = None
    ) -> Any:
        """Loader-thread job: read `key` into tier 2 (CPU: returns the stored bytes); on CUDA with
        `stage` also start the copy into the spare buffer (the consumer waits on its event).
        `SKIPPED` when `still_wanted` said no before the read began.

        Tier 2 is looked at again once the link is ours: with two loader threads another load of
        the same block may have read it while this one waited."""

        def worth_reading() -> bool:
            with self.lock:
                if key in self.host:
                    return False
            return still_wanted is None or still_wanted()

        with self.lock:
            value = self.host.peek(key)
        if value is None:
            value = self.read_block(key, urgent=False, still_wanted=worth_reading)
            if value is None:
                with self.lock:
                    value = self.host.peek(key)
                if value is None:
                    return SKIPPED
            else:
                with self.lock:  # a demand load may have promoted it meanwhile: no second copy
                    moved = key in self.moves_up if self.cuda else self.exclusive
                    if not (moved and key in self.fast):
                        self.host.put(key, value, self.host_nbytes(key, value))
        if self.cuda:
            return self.copies.start(value) if stage else None
        return value


def shares_memory(w: ExpertWeights, stored: Any) -> bool:
    """Whether every projection of `w` is a view into the buffer `stored` (zero-copy decode)."""
    if not len(stored):
        return False
    base = torch.frombuffer(stored, dtype=torch.uint8)
    lo, hi = base.data_ptr(), base.data_ptr() + base.numel()
    return all(lo <= t.data_ptr() < hi for t in w.tensors().values())
