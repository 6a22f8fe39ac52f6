"""Pre-gating prefetch of the coming layers' experts, with accuracy counters.

While layer L computes, `predict` applies the router of layer L+d (d = 1..depth) to layer L's
MoE input (pre-gating: the residual stream changes little from one layer to the next, so the later
router on the current hidden state picks mostly the same experts) and tops the set up with the
layer's most frequent experts (decayed routing-frequency priors). `issue` hands the loads to the
two loader threads (an O_DIRECT read of the block into tier 2; CUDA: then decoded into pinned
memory and a non_blocking copy on a side stream into the spare buffer, its end marked by an
event), nearer layers first. Looking more than one layer ahead keeps the disk busy through
attention and the layers whose experts are all in RAM (measured on the bench model: 1/2/3 layers
ahead, top-2 precision 0.89/0.84/0.80).

When layer L starts, `begin_layer` scores the one-layer-ahead prediction against the experts its
router chose and cancels the queued loads nobody will take (layer L's unchosen experts, earlier
layers'); one already running but still waiting for the link skips its read (`wanted`). Loads for
later layers stay. The loaders take queued loads nearest layer first (`LayerOrderedLoaders`), so
`take(key)` may wait for a queued load of layer L: everything run before it is also needed by
layer L, so waiting never puts a demand behind a useless read, and a block is never read twice.

Counters (one-layer-ahead prediction): precision = predicted-and-used / predicted, recall =
predicted-and-used / used, and the same for a frequency-only predictor (the baseline pre-gating
must beat); loads issued / taken / cancelled / wasted.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..model.experts import ExpertKey
from .pregate import pregate

logger = logging.getLogger(__name__)


@dataclass
class PrefetchCounters:
    """Prediction and load counters (keys, summed over layers and steps)."""

    predicted: int = 0
    used: int = 0
    predicted_and_used: int = 0
    baseline_predicted: int = 0
    baseline_predicted_and_used: int = 0
    issued: int = 0
    taken: int = 0  # demand found its load done, running or queued (and waited for it)
    cancelled: int = 0  # queued loads of experts the router did not choose, dropped unread
    wasted: int = 0  # loads that were read but not used by the layer they were made for

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = asdict(self)
        d["precision"] = self.predicted_and_used / self.predicted if self.predicted else 0.0
        d["recall"] = self.predicted_and_used / self.used if self.used else 0.0
        d["baseline_precision"] = (
            self.baseline_predicted_and_used / self.baseline_predicted if self.baseline_predicted else 0.0
        )
        d["baseline_recall"] = self.baseline_predicted_and_used / self.used if self.used else 0.0
        return d


class LayerOrderedLoaders:
    """Loader threads that run queued loads nearest layer first (issue order among equals).

    A plain FIFO pool ran them in issue order, so a next-layer expert first predicted at layer L
    waited behind the loads for layers L+2 and L+3 issued one step earlier, and the next layer's
    `take` waited for reads of deeper layers. `submit` returns a `Future`; one cancelled while
    queued is skipped.
    """

    def __init__(self, load: Callable[[ExpertKey], Any], threads: int) -> None:
        self.load = load
        self._heap: list[tuple[int, int, ExpertKey, Future[Any]]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"ft-prefetch-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, key: ExpertKey) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the loaders are closed")
            heapq.heappush(self._heap, (key[0], next(self._seq), key, fut))
            self._cv.notify()
        return fut

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                _, _, key, fut = heapq.heappop(self._heap)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self.load(key))
            except BaseException as exc:  # handed to whoever takes the load
                fut.set_exception(exc)

    def close(self) -> None:
        """Cancel the queued loads, let running ones finish, stop the threads."""
        with self._cv:
            self._closed = True
            for *_, fut in self._heap:
                fut.cancel()
            self._cv.notify_all()
        for t in self._threads:
            t.join()


class Skipped:
    """What a load returns when it skipped its read because `Prefetcher.wanted` said no."""


SKIPPED = Skipped()


class Prefetcher:
    """Predicts and loads the coming layers' experts.

    Args:
        load: `load(key) -> value` run on a loader thread (must be thread-safe; the provider's).
        use_thread: False runs loads inline in `issue` (deterministic tests).
        max_inflight: cap on loads issued and not yet finished.
        loaders: loader threads. With a `load` whose reads take the link one at a time
            (`BlockReader`'s `LinkQueue`), a second thread starts the next read while the first
            verifies the block it read (xxhash64 of a 25 MB block: ~4.5 ms here, the GIL
            released): one thread left the link idle that long after every read, ~25% of decode
            time in bench/offload.py.
    """

    def __init__(
        self,
        load: Callable[[ExpertKey], Any],
        *,
        use_thread: bool = True,
        max_inflight: int = 8,
        loaders: int = 1,
    ) -> None:
        self.load, self.max_inflight = load, max_inflight
        self.counters = PrefetchCounters()
        self._pool = LayerOrderedLoaders(load, loaders) if use_thread else None
        self._pending: dict[ExpertKey, Future[Any]] = {}  # loads for layers that have not started
        self._current: dict[ExpertKey, Future[Any]] = {}  # loads the running layer will take
        self._predictions: dict[int, tuple[set[int], set[int]]] = {}  # layer -> (pregated, baseline)
        self._abandoned: set[ExpertKey] = set()  # dropped while running: skip the read if not begun
        self._count_lock = threading.Lock()  # loader threads count the loads they end

    def predict(
        self,
        layer: int,
        hidden: torch.Tensor,
        router: torch.nn.Module | None,
        top_k: int,
        frequency: dict[int, float],
        *,
        score: bool = True,
        pregated: list[int] | None = None,
    ) -> list[int]:
        """Predicted experts of `layer` (pre-gated first, then priors): `top_k` for decode, twice
        that for prefill (the most-voted over the tokens). `score`: this is the one-layer-ahead
        prediction the counters judge (deeper ones are not scored). `pregated`: what `router`
        picks, already computed (`AheadRouters`), in `pregate`'s order."""
        limit = top_k * (1 if hidden.shape[0] == 1 else 2)
        if pregated is not None:
            pred = pregated[:limit]
        else:
            pred = pregate(router, hidden, limit) if router is not None else []
        if len(pred) < limit:
            for e in sorted(frequency, key=frequency.__getitem__, reverse=True):
                if len(pred) >= limit:
                    break
                if e not in pred:
                    pred.append(e)
        if score:  # the frequency-only baseline: the most frequent, as many (a sort of E: only here)
            # (`sorted` then a slice: the same experts as `heapq.nlargest`, at under half its cost
            # over Qwen3-30B's 128 experts, on every layer.)
            baseline = sorted(frequency, key=frequency.__getitem__, reverse=True)[: len(pred)]
            self._predictions[layer] = (set(pred), set(baseline))
        return pred

    def inflight(self) -> int:
        return sum(not f.done() for f in self._pending.values())

    def issue(self, layer: int, experts: list[int], skip: Callable[[ExpertKey], bool]) -> None:
        """Queue loads of `(layer, e)` (skipping keys already loading or that `skip` says are in
        memory), while fewer than `max_inflight` loads are unfinished.

        A layer is predicted again from each nearer layer, and a nearer prediction is the more
        precise one (0.80 -> 0.89 three vs one layer ahead on the bench model), so the latest
        prediction replaces the earlier ones: this layer's queued loads it dropped are cancelled
        before they take the link from useful reads (ones already running finish)."""
        wanted = set(experts)
        for key in [k for k in self._pending if k[0] == layer and k[1] not in wanted]:
            self._drop(key, self._pending.pop(key))
        for e in experts:
            key = (layer, e)
            if key in self._pending or key in self._current or skip(key):
                continue
            if self.inflight() >= self.max_inflight:
                break
            self.counters.issued += 1
            self._abandoned.discard(key)
            if self._pool is None:
                fut: Future[Any] = Future()
                try:
                    fut.set_result(self.load(key))
                except Exception as exc:  # reported by the demand load that retries it
                    fut.set_exception(exc)
            else:
                fut = self._pool.submit(key)
            self._pending[key] = fut

    def begin_layer(self, layer: int, used: list[int]) -> None:
        """`layer` starts with routed experts `used`: score its prediction, hand its loads to
        `take`, cancel the queued loads nobody will take (those already read stay in tier 2)."""
        pred = self._predictions.pop(layer, None)
        c = self.counters
        if pred is not None:  # recall counts only layers that had a prediction (not the first)
            c.used += len(used)
            pregated, baseline = pred
            c.predicted += len(pregated)
            c.predicted_and_used += len(pregated & set(used))
            c.baseline_predicted += len(baseline)
            c.baseline_predicted_and_used += len(baseline & set(used))
        stale = list(self._current.items())  # the previous layer's loads nobody took
        self._current = {}
        wanted = set(used)
        for key in list(self._pending):
            if key[0] == layer and key[1] in wanted:
                self._current[key] = self._pending.pop(key)
            elif key[0] <= layer:  # never loads across a token boundary: later layers stay
                stale.append((key, self._pending.pop(key)))
        for key, fut in stale:
            self._drop(key, fut)

    def wanted(self, key: ExpertKey) -> bool:
        """Whether `key`'s running load should still read its block: False once it was dropped
        (a loader waiting for the link then skips the read and returns `SKIPPED`)."""
        return key not in self._abandoned

    def _drop(self, key: ExpertKey, fut: Future[Any]) -> None:
        """Nobody will take this load: cancel it if queued. If a loader already runs it (with two
        loaders, often still waiting for the link) mark it abandoned, so that a read not yet begun
        is skipped, and count it when it ends: cancelled if skipped, wasted if it read."""
        if fut.cancel():
            with self._count_lock:
                self.counters.cancelled += 1
            return
        if fut.cancelled():
            return
        self._abandoned.add(key)
        fut.add_done_callback(self._count_dropped)

    def _count_dropped(self, fut: Future[Any]) -> None:
        skipped = fut.exception() is None and isinstance(fut.result(), Skipped)
        with self._count_lock:
            if skipped:
                self.counters.cancelled += 1
            else:
                self.counters.wasted += 1

    def take(self, key: ExpertKey) -> Any | None:
        """The prefetched value of `key` (waiting for its load, queued or running), or None if it
        was not prefetched or its load failed (the demand load then retries and reports)."""
        fut = self._current.pop(key, None)
        if fut is None:
            return None
        try:
            value = fut.result()
        except Exception:  # a failed prefetch is retried (and reported) by the demand load
            logger.debug("prefetch of %s failed; demand load will retry", key, exc_info=True)
            return None
        if isinstance(value, Skipped):  # dropped, then wanted again before its loader read
            return None
        self.counters.taken += 1
        return value

    def stats(self) -> dict[str, float]:
        """The prefetch counters with precision and recall (`PrefetchCounters`)."""
        return self.counters.as_dict()

    def close(self) -> None:
        """Cancel queued loads and stop the loader threads."""
        for fut in [*self._pending.values(), *self._current.values()]:
            fut.cancel()
        self._pending, self._current = {}, {}
        if self._pool is not None:
            self._pool.close()
