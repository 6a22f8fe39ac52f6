"""q*: RESIDENT / STREAM / HOST as the costs dictate; prefill and decode differ; adaptivity."""

from __future__ import annotations

import pytest

from freetoken_agents.engine.memory import (
    BandwidthOracle,
    ComputeCostModel,
    ExpertCase,
    ManualClock,
    Placement,
    QStarPolicy,
    ThrottledLink,
)

MB = 10**6


def _policy(storage_bps: float = 2e9, fast_bps: float = 25e9, act_bps: float | None = 25e9) -> QStarPolicy:
    return QStarPolicy(
        BandwidthOracle("storage->host", prior_bps=storage_bps),
        BandwidthOracle("host->fast", prior_bps=fast_bps),
        BandwidthOracle("activations", prior_bps=act_bps) if act_bps else None,
        ComputeCostModel(),
        fast_device="cuda",
        host_device="cpu",
    )


def _case(tokens: int = 1, **kw) -> ExpertCase:
    base = dict(
        tokens=tokens,
        codec="bf16",
        resident=False,
        in_host=True,
        stored_bytes=10 * MB,
        fast_bytes=10 * MB,
        activation_bytes=tokens * 16_384,
    )
    base.update(kw)
    return ExpertCase(**base)


def test_injected_costs_pick_each_placement():
    p = _policy()
    p.compute.set("cuda", "decoded", 1, 50e-6)
    p.compute.set("cpu", "bf16", 1, 5e-3)  # host compute slow: stream (0.4 ms + 0.05 ms) wins
    assert p.decide((0, 0), _case(resident=True)) is Placement.RESIDENT
    assert p.decide((0, 1), _case()) is Placement.STREAM
    p.compute.set("cpu", "bf16", 1, 0.1e-3)  # host compute cheap: compute there
    assert p.decide((0, 2), _case()) is Placement.HOST
    assert p.decisions == {"resident": 1, "stream": 1, "host": 1}


def test_eviction_of_a_hot_expert_is_charged():
    p = _policy()
    p.compute.set("cuda", "decoded", 1, 50e-6)
    p.compute.set("cpu", "bf16", 1, 0.5e-3)
    assert p.decide((0, 1), _case()) is Placement.STREAM
    hot_victim = [(2e-3, 50.0)]  # reload 2 ms, far hotter than the candidate
    assert p.decide((0, 1), _case(victims=hot_victim, frequency=0.1)) is Placement.HOST


def test_a_swap_must_win_by_more_than_the_frequencies_noise():
    """A decayed count of uses varies by ~sqrt(f / 2) by chance: a candidate used 8% more often
    than its victim lately is no evidence it will be used more, and swapping on it bought
    nothing but the copy (Mixtral / RTX 4090 / 50% replay: 612 swaps in 577 tokens, no fewer
    misses). A clearly hotter candidate still displaces a colder victim."""
    p = _policy()
    p.compute.set("cuda", "decoded", 1, 50e-6)
    p.compute.set("cpu", "bf16", 1, 0.5e-3)  # a copy 0.4 ms: each use in tier 1 is worth 0.4 ms
    victim = [(0.4e-3, 24.0)]
    # Without a margin: 0.4 + 0.05 + 24 x 0.4 - 26 x 0.4 = -0.35 ms, below 0.5 ms on the host;
    # the margin, sqrt(50 / 2) x 0.4 = 2 ms, makes it 1.65 ms.
    assert p.decide((0, 1), _case(victims=victim, frequency=26.0)) is Placement.HOST
    assert p.decide((0, 1), _case(victims=victim, frequency=40.0)) is Placement.STREAM
    # No victims (free room): no margin to win.
    assert p.decide((0, 1), _case(frequency=0.5, free_room=True)) is Placement.STREAM


def test_measured_like_costs_make_decode_and_prefill_differ():
    """CPU GEMM cost grows with tokens, the PCIe copy of the weights does not (Fiddler)."""
    p = _policy()
    for _ in range(5):  # as the provider feeds measurements
        p.compute.observe("cuda", "decoded", 1, 40e-6)
        p.compute.observe("cuda", "decoded", 512, 0.6e-3)
        p.compute.observe("cpu", "bf16", 1, 0.25e-3)  # GEMV over 10 MB at ~40 GB/s
        p.compute.observe("cpu", "bf16", 512, 60e-3)  # GEMM, compute bound
    decode = p.decide((3, 1), _case(tokens=1))
    prefill = p.decide((3, 1), _case(tokens=512))
    assert (decode, prefill) == (Placement.HOST, Placement.STREAM)
    assert p.decisions_by_phase == {"decode/host": 1, "prefill/stream": 1}
    # An unmeasured bucket is extrapolated from the nearest measured one below.
    assert p.compute.estimate("cpu", "bf16", 1024) == p.compute.estimate("cpu", "bf16", 512) * 2


def test_free_room_fills_fast_memory():
    p = _policy()
    p.compute.set("cuda", "decoded", 1, 50e-6)
    p.compute.set("cpu", "bf16", 1, 0.1e-3)
    assert p.decide((0, 0), _case(free_room=True)) is Placement.STREAM


def test_free_room_is_not_filled_by_queueing_behind_a_busy_link():
    """A cold tier 1 was filled by demand copies however long the link's queue: each waited for
    the copies ahead of it while the CPU could have computed the expert at once."""
    p = _policy()
    p.compute.set("cpu", "bf16", 1, 0.1e-3)
    busy = _case(free_room=True, link_wait_s=2e-3)
    assert p.decide((0, 0), busy) is Placement.STREAM  # the device not measured yet: seed it
    p.compute.set("cuda", "decoded", 1, 50e-6)
    assert p.decide((0, 1), busy) is Placement.HOST  # 0.1 ms on the CPU, not 2.4 ms
    assert p.decide((0, 2), _case(free_room=True)) is Placement.STREAM  # an idle link: fill
    assert p.decide((0, 3), _case(free_room=True, link_wait_s=2e-3, frequency=50.0)) is Placement.STREAM


def test_throttled_link_mid_run_oracle_follows_within_300ms_and_qstar_flips_and_back():
    """One decision per transfer, as a run makes them. The host->fast link drops from 25 GB/s to
    1 GB/s mid-run and comes back: within 300 ms of transfers the estimate is within 10% of the
    new bandwidth and q* has moved STREAM -> HOST (and HOST -> STREAM), and stays there. A single
    40x stall at high bandwidth is an outlier: it moves neither."""
    clock = ManualClock()
    fast = BandwidthOracle("host->fast", clock=clock)
    link = ThrottledLink(fast, clock, 25e9)
    p = QStarPolicy(BandwidthOracle("storage->host", prior_bps=2e9), fast, None, ComputeCostModel())
    p.compute.set("fast", "decoded", 1, 50e-6)
    p.compute.set("host", "bf16", 1, 1e-3)  # stream wins at 25 GB/s (0.45 ms), host at 1 GB/s

    def step() -> tuple[float, Placement]:
        return link.transfer(10 * MB), p.decide((0, 0), _case())

    for _ in range(32):
        assert step()[1] is Placement.STREAM
    link.jitter = lambda: 40.0  # one stall
    assert step()[1] is Placement.STREAM
    link.jitter = None
    assert step()[1] is Placement.STREAM and fast.changes == 0
    for bw, want in ((1e9, Placement.HOST), (25e9, Placement.STREAM)):
        link.bytes_per_s = bw
        spent, tracked_at, flipped_at, seen = 0.0, None, None, []
        while spent < 1.0:
            dt, choice = step()
            spent += dt
            seen.append(choice)
            if tracked_at is None and abs(fast.estimate() - bw) <= 0.1 * bw:  # type: ignore[operator]
                tracked_at = spent
            if flipped_at is None and choice is want:
                flipped_at = spent
        assert tracked_at is not None and tracked_at <= 0.3, tracked_at
        assert flipped_at is not None and flipped_at <= 0.3, flipped_at
        assert all(c is want for c in seen[seen.index(want) :])  # no flapping once moved
    assert fast.changes == 2


def test_stream_is_priced_by_the_bytes_the_link_moves_plus_the_device_decode():
    """CUDA tier 2 holds compact blocks: a 4x smaller MXFP4 copy makes STREAM win where the bf16
    copy lost to HOST, and a measured device decode is added to the copy."""
    p = _policy()
    p.compute.set("cuda", "decoded", 1, 50e-6)
    p.compute.set("cpu", "mxfp4", 1, 0.3e-3)
    bf16 = _case(codec="mxfp4", stored_bytes=10 * MB)  # 0.4 ms copy: HOST (0.3 ms) wins
    assert p.decide((0, 1), bf16) is Placement.HOST
    compact = _case(codec="mxfp4", stored_bytes=10 * MB, link_bytes=10 * MB // 4)  # 0.1 ms copy
    costs = p.costs(compact)
    assert costs[Placement.STREAM] < costs[Placement.HOST]
    slow_decode = _case(codec="mxfp4", stored_bytes=10 * MB, link_bytes=10 * MB // 4, decode_s=1e-3)
    assert p.costs(slow_decode)[Placement.STREAM] == pytest.approx(costs[Placement.STREAM] + 1e-3)
    assert p.decide((0, 1), slow_decode) is Placement.HOST


def test_measured_answers_only_from_measurements():
    c = ComputeCostModel(prior_seconds=1e-3)
    assert c.measured("cuda", "decode/mxfp4", 1) is None and c.estimate("cuda", "decode/mxfp4", 1) == 1e-3
    c.observe("cuda", "decode/mxfp4", 1, 20e-6)
    assert c.measured("cuda", "decode/mxfp4", 1) == 20e-6


def test_an_unmeasured_host_is_tried_once_on_a_decode_token():
    """With the host never measured, its cost is the prior's guess (1 ms an expert). Where that
    guess loses to a copy, q* never computed on the host and so never learned that it is cheaper
    there: a simulated Qwen3-30B-A3B on an H200 with half the expert bytes in tier 1 streamed every
    miss (127 tok/s; 242 with the host tried once)."""
    p = _policy()
    p.compute.set("cuda", "decoded", 1, 50e-6)  # a copy (0.4 ms) + 0.05 ms beats the 1 ms prior
    assert p.decide((0, 1), _case(tokens=64)) is Placement.STREAM  # a prefill: not tried there
    assert p.decide((0, 2), _case()) is Placement.HOST  # tried on a decode token
    p.compute.observe("cpu", "bf16", 1, 0.1e-3)  # what that computation measured
    assert p.decide((0, 3), _case()) is Placement.HOST  # cheaper, and now known to be
    p.compute.set("cpu", "bf16", 1, 50e-3)  # a slow host, measured: the costs decide again
    assert p.decide((0, 4), _case()) is Placement.STREAM
    # Filling free room comes first: it also measures the device.
    assert p.decide((0, 5), _case(free_room=True)) is Placement.STREAM


def test_an_unmeasured_codec_is_answered_without_scanning_every_measurement():
    """`measured` runs several times per q* decision; a codec never measured (an MXFP4 device
    decode that never happens) scanned every entry each time (~1 us of a ~20 us decision at
    Qwen3-30B's scale). Buckets are indexed per (device, codec); the answers stay the same."""

    class CountingDict(dict):
        scans = 0

        def __iter__(self):
            type(self).scans += 1
            return super().__iter__()

    m = ComputeCostModel()
    m._ema = CountingDict()
    m.observe("cuda", "decoded", 1, 2e-5)
    m.set("cpu-host", "mxfp4", 4, 8e-4)
    m.observe("cpu-host", "mxfp4", 1, 3e-4)
    assert m.measured("cuda", "decode/mxfp4", 1) is None
    assert m.measured("cpu-host", "mxfp4", 2) == pytest.approx(3e-4 * 2)  # the bucket below, scaled
    assert m.measured("cpu-host", "mxfp4", 16) == pytest.approx(8e-4 * 4)
    assert m.measured("cpu-host", "int8", 1) is None
    assert m.estimate("cpu-host", "int8", 3) == m.prior_seconds * 3
    m.observe("cpu-host", "mxfp4", 3, 9e-4)  # bucket 4: 9e-4 x 4 / 3 folded into the EMA
    assert m.measured("cpu-host", "mxfp4", 4) == pytest.approx(0.8 * 8e-4 + 0.2 * 12e-4)
    assert CountingDict.scans == 0


def test_a_measurement_observed_n_times_in_one_call_is_n_observations() -> None:
    """A layer of resident experts timed together credits each its share in one call
    (`times=n`): the model ends exactly where n calls would have left it, first or later."""
    one_by_one, at_once = ComputeCostModel(), ComputeCostModel()
    for seconds in (3e-4, 1e-4, 2e-4):
        for _ in range(8):
            one_by_one.observe("cpu", "decoded", 1, seconds)
        at_once.observe("cpu", "decoded", 1, seconds, times=8)
        assert at_once.estimate("cpu", "decoded", 1) == one_by_one.estimate("cpu", "decoded", 1)
