"""Pre-gating prefetch into the spare half of a double buffer, with accuracy counters.

While layer L computes, `predict` applies layer L+1's router to layer L's MoE input (pre-gating)
and tops the set up with the layer's most frequent experts (decayed routing-frequency priors).
`issue` hands the loads to one loader thread (CPU: pread + decode; CUDA: decode into pinned
memory + a non_blocking copy on a side stream, completion marked by an event). The loads fill the
*spare* buffer; when layer L+1 starts (`begin_layer`) the spare becomes the current buffer and
the prediction is scored against the experts the real router chose.

Never delaying a demand load: `take(key)` returns a finished (or already running) load, but a
load still queued is cancelled and the caller loads on demand itself; `begin_layer` cancels every
queued load of other layers. At most `max_inflight` loads are queued at a time.

Counters: precision = predicted-and-used / predicted, recall = predicted-and-used / used, plus the
same for a frequency-only predictor (the baseline pre-gating must beat) and load hits / wastes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..experts import ExpertKey

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
    taken: int = 0  # demand found its load ready (or running) in the buffer
    cancelled: int = 0  # queued loads dropped so that they do not delay demand
    wasted: int = 0  # loads finished but never used

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = asdict(self)
        d["precision"] = self.predicted_and_used / self.predicted if self.predicted else 0.0
        d["recall"] = self.predicted_and_used / self.used if self.used else 0.0
        d["baseline_precision"] = (
            self.baseline_predicted_and_used / self.baseline_predicted if self.baseline_predicted else 0.0
        )
        d["baseline_recall"] = self.baseline_predicted_and_used / self.used if self.used else 0.0
        return d


def pregate(router: torch.nn.Module, hidden: torch.Tensor, limit: int) -> list[int]:
    """Experts layer L+1's `router` would pick for `hidden [T, H]`, most-voted first, <= limit."""
    with torch.inference_mode():
        ids, _ = router(hidden)  # [T, A]
    votes = torch.bincount(ids.reshape(-1))
    order = torch.argsort(votes, descending=True, stable=True)
    return [int(e) for e in order[: min(limit, int((votes > 0).sum()))]]


class Prefetcher:
    """Predicts and loads the next layer's experts.

    Args:
        load: `load(key) -> value` run on the loader thread (must be thread-safe; the provider's).
        use_thread: False runs loads inline in `issue` (deterministic tests).
        max_inflight: cap on queued loads.
    """

    def __init__(
        self, load: Callable[[ExpertKey], Any], *, use_thread: bool = True, max_inflight: int = 8
    ) -> None:
        self.load, self.max_inflight = load, max_inflight
        self.counters = PrefetchCounters()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ft-prefetch") if use_thread else None
        self._spare: dict[ExpertKey, Future[Any]] = {}
        self._current: dict[ExpertKey, Future[Any]] = {}
        self._predictions: dict[int, tuple[set[int], set[int]]] = {}  # layer -> (pregated, baseline)

    def predict(
        self,
        layer: int,
        hidden: torch.Tensor,
        router: torch.nn.Module | None,
        top_k: int,
        frequency: dict[int, float],
        extra: int = 0,
    ) -> list[int]:
        """Predicted experts of `layer` (pre-gated first, then priors), `top_k + extra` at most
        for decode; prefill widens to the union of what the tokens vote for, same cap x T."""
        limit = (top_k + extra) * (1 if hidden.shape[0] == 1 else 2)
        pred = pregate(router, hidden, limit) if router is not None else []
        priors = sorted(frequency, key=lambda e: -frequency[e])
        for e in priors:
            if len(pred) >= limit:
                break
            if e not in pred:
                pred.append(e)
        self._predictions[layer] = (set(pred), set(priors[: len(pred)]))
        return pred

    def issue(self, layer: int, experts: list[int], skip: Callable[[ExpertKey], bool]) -> None:
        """Queue loads of `(layer, e)` into the spare buffer (skipping keys `skip` says are there)."""
        for e in experts:
            key = (layer, e)
            if key in self._spare or key in self._current or skip(key):
                continue
            if len(self._spare) >= self.max_inflight:
                break
            self.counters.issued += 1
            if self._pool is None:
                fut: Future[Any] = Future()
                fut.set_result(self.load(key))
            else:
                fut = self._pool.submit(self.load, key)
            self._spare[key] = fut

    def begin_layer(self, layer: int, used: list[int]) -> None:
        """`layer` starts with routed experts `used`: score its prediction, swap the buffers."""
        pred = self._predictions.pop(layer, None)
        c = self.counters
        if pred is not None:  # recall counts only layers that had a prediction (not the first)
            c.used += len(used)
            pregated, baseline = pred
            c.predicted += len(pregated)
            c.predicted_and_used += len(pregated & set(used))
            c.baseline_predicted += len(baseline)
            c.baseline_predicted_and_used += len(baseline & set(used))
        for fut in self._current.values():
            if fut.done() and not fut.cancelled():
                c.wasted += 1
        self._current = {k: f for k, f in self._spare.items() if k[0] == layer}
        for key, fut in self._spare.items():
            if key[0] != layer and fut.cancel():
                c.cancelled += 1
        self._spare = {}

    def take(self, key: ExpertKey) -> Any | None:
        """The prefetched value of `key` if its load finished or is running, else None."""
        fut = self._current.pop(key, None)
        if fut is None:
            return None
        if fut.cancel():  # still queued: cancel, demand-load instead of waiting behind it
            self.counters.cancelled += 1
            return None
        try:
            value = fut.result()
        except Exception:  # a failed prefetch is retried (and reported) by the demand load
            logger.debug("prefetch of %s failed; demand load will retry", key, exc_info=True)
            return None
        self.counters.taken += 1
        return value

    def close(self) -> None:
        """Cancel queued loads and stop the loader thread."""
        for fut in [*self._spare.values(), *self._current.values()]:
            fut.cancel()
        self._spare, self._current = {}, {}
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
