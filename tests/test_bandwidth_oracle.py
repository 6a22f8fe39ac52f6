"""BandwidthOracle with an injected clock: step changes tracked fast, outliers rejected."""

from __future__ import annotations

import itertools

import pytest

from freetoken_agents.engine.memory import BandwidthOracle, ManualClock, ThrottledLink

MiB = 1 << 20


def _until_tracked(link: ThrottledLink, nbytes: int, target: float, tol: float = 0.1) -> float:
    """Transfer until the estimate is within `tol` of `target`; returns the transfer seconds spent."""
    spent = 0.0
    for _ in range(1000):
        spent += link.transfer(nbytes)
        est = link.oracle.estimate()
        if est is not None and abs(est - target) <= tol * target:
            return spent
    raise AssertionError("never tracked")


@pytest.mark.parametrize("nbytes", [MiB, 16 * MiB, 64 * MiB])
def test_step_change_tracked_within_300ms_of_transfers(nbytes):
    clock = ManualClock()
    oracle = BandwidthOracle("host->fast", clock=clock)
    link = ThrottledLink(oracle, clock, 10e9)
    for _ in range(32):
        link.transfer(nbytes)
    assert oracle.estimate() == pytest.approx(10e9, rel=1e-6)
    link.bytes_per_s = 0.5e9  # drop 20x
    assert _until_tracked(link, nbytes, 0.5e9) <= 0.3
    link.bytes_per_s = 10e9  # and back
    assert _until_tracked(link, nbytes, 10e9) <= 0.3
    assert oracle.changes == 2


def test_isolated_outliers_are_rejected():
    clock = ManualClock()
    oracle = BandwidthOracle("storage->host", clock=clock)
    jitter = itertools.cycle([1.0, 1.05, 0.95, 1.02, 0.98, 1.0, 1.0, 40.0])  # every 8th: a 40x stall
    link = ThrottledLink(oracle, clock, 2e9, jitter=lambda: next(jitter))
    for _ in range(200):
        link.transfer(4 * MiB)
        if oracle.samples > 8:
            assert oracle.estimate() == pytest.approx(2e9, rel=0.06)
    assert oracle.outliers >= 200 // 8 - 1
    assert oracle.changes == 0


def test_prior_and_unknown():
    assert BandwidthOracle("x").estimate() is None
    assert BandwidthOracle("x").seconds_for(10) == float("inf")
    assert BandwidthOracle("x", prior_bps=1e9).seconds_for(10**9) == pytest.approx(1.0)


class _FakeEvent:
    """A CUDA event stand-in: `query()` says whether the copy finished, and may run `on_query`
    (a loader thread queuing its next copy while the compute thread polls)."""

    def __init__(self, ms: float = 0.0, done: bool = True, on_query=None) -> None:
        self.ms, self.done, self.on_query = ms, done, on_query

    def query(self) -> bool:
        if self.on_query is not None:
            self.on_query()
        return self.done

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.ms - self.ms


def test_a_cuda_copy_queued_while_polling_is_not_lost():
    oracle = BandwidthOracle("host->fast", prior_bps=None)
    late = (_FakeEvent(0.0), _FakeEvent(2.0), 2 * MiB)
    queues_late = _FakeEvent(1.0, on_query=lambda: oracle.record_cuda_copy(*late))
    oracle.record_cuda_copy(_FakeEvent(0.0), queues_late, MiB)
    oracle.record_cuda_copy(_FakeEvent(0.0), _FakeEvent(5.0, done=False), MiB)  # still copying
    oracle.poll()
    assert oracle.samples == 1  # the finished copy
    oracle.poll()
    assert oracle.samples == 2  # the one queued during the first poll was kept and is folded in now
    assert oracle.bytes_total == 3 * MiB


def test_stats_fold_in_finished_cuda_copies():
    oracle = BandwidthOracle("host->fast", prior_bps=None)
    oracle.record_cuda_copy(_FakeEvent(0.0), _FakeEvent(4.0), 4 * MiB)  # 4 MiB in 4 ms
    s = oracle.stats()
    assert s["samples"] == 1 and s["estimate_bps"] == pytest.approx(MiB / 1e-3)


def test_the_estimate_is_the_median_of_the_window_through_outliers_and_changes():
    """The estimate is kept from a sorted copy of the window (not re-sorted per sample): over a
    long noisy run with lone outliers and regime changes it is still exactly the median of the
    rates the window holds."""
    import random
    import statistics

    rng = random.Random(0)
    oracle = BandwidthOracle("link", window=8)
    level = 1e9
    for i in range(2000):
        if i % 300 == 299:
            level *= rng.choice([0.3, 3.0])  # a new regime: confirmed after a few samples
        rate = level * rng.uniform(0.9, 1.1) * (5.0 if rng.random() < 0.03 else 1.0)  # lone outliers
        oracle.record(1_000_000, 1_000_000 / rate)
        assert oracle.estimate() == statistics.median(oracle._rates)
    assert oracle.changes >= 3 and oracle.outliers > 0
