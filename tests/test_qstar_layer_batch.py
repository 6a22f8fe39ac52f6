"""q* on a GPU machine, where the link and the CPU work beside the device: a layer's misses are
spread over both (each decision sees what the link and the CPU are already busy with), a
prefetched copy is computed once without evicting anything (STAGED), a copy is staged only when it
lands in time, one miss is split over both (SPLIT), and residency is worth what a later miss would
cost, not a copy plus a compute."""

from __future__ import annotations

import pytest

from freetoken_agents.engine.memory import (
    BandwidthOracle,
    ComputeCostModel,
    ExpertCase,
    FastTier,
    HostTier,
    ManualClock,
    Placement,
    QStarPolicy,
)
from freetoken_agents.engine.memory.planner import ExpertPlanner
from freetoken_agents.engine.memory.policy import DOWN_SHARE
from freetoken_agents.engine.memory.routing import RoutingFrequency

MB = 10**6
COPY_S = 4e-3  # 100 MB over a 25 GB/s link
HOST_S = 1.4e-3  # computing it on the CPU
FAST_S = 0.1e-3  # computing it on the GPU


def _policy() -> QStarPolicy:
    compute = ComputeCostModel()
    compute.set("cuda", "decoded", 1, FAST_S)
    compute.set("cpu-host", "mxfp4", 1, HOST_S)
    return QStarPolicy(
        BandwidthOracle("storage->host", prior_bps=5e9),
        BandwidthOracle("host->fast", prior_bps=100 * MB / COPY_S),
        BandwidthOracle("activations", prior_bps=25e9),
        compute,
        fast_device="cuda",
        host_device="cpu-host",
    )


def _case(**kw) -> ExpertCase:
    base = dict(
        tokens=1,
        codec="mxfp4",
        resident=False,
        in_host=True,
        stored_bytes=100 * MB,
        fast_bytes=100 * MB,
        activation_bytes=16_384,
    )
    base.update(kw)
    return ExpertCase(**base)


def test_a_hot_experts_residency_is_worth_a_host_compute_not_a_copy_plus_a_compute() -> None:
    """Used ~2 more times soon, it saves at most the cheaper of computing it on the CPU and copying
    it back each time (1.3 ms), not both (5.3 ms): streaming it (4 ms now) is not worth it."""
    p = _policy()
    assert p.decide((0, 1), _case(frequency=2.0)) is Placement.HOST
    assert p.decide((0, 2), _case(frequency=8.0)) is Placement.STREAM  # used often enough: keep it


def test_a_staged_copy_is_computed_once_when_keeping_it_would_evict_a_hotter_expert() -> None:
    p = _policy()
    hot_victim = [(COPY_S, 5.0)]
    assert (
        p.decide((0, 1), _case(staged=True, prefetched_s=float("inf"), victims=hot_victim))
        is Placement.STAGED
    )
    # Without a staged copy the same expert is computed on the CPU.
    assert p.decide((0, 2), _case(victims=hot_victim)) is Placement.HOST
    # A staged copy still on the link: waiting for it costs more than the CPU's compute.
    late = _case(staged=True, prefetched_s=float("inf"), victims=hot_victim, staged_wait_s=3e-3)
    assert p.decide((0, 3), late) is Placement.HOST


def test_the_busy_link_and_the_busy_cpu_are_priced() -> None:
    p = _policy()
    assert p.decide((0, 1), _case(frequency=8.0)) is Placement.STREAM
    assert p.decide((0, 2), _case(frequency=8.0, link_wait_s=8e-3)) is Placement.HOST
    assert p.decide((0, 3), _case(host_wait_s=5e-3)) is Placement.STREAM


def _planner(clock: ManualClock, capacity_experts: int = 4, layers: int = 2) -> ExpertPlanner:
    fast: FastTier[bool] = FastTier(capacity_experts * 100 * MB)
    host: HostTier[bool] = HostTier(None)
    keys = [(lay, e) for lay in range(layers) for e in range(8)]
    for k in keys:
        host.put(k, True, 100 * MB)
    for e in range(capacity_experts):  # tier 1 full of equally warm experts of layer 1
        fast.put((1, e), True, 100 * MB)
    routing = RoutingFrequency(range(layers))
    routing.note(1, list(range(capacity_experts)))
    return ExpertPlanner(
        fast=fast,
        host=host,
        policy=_policy(),
        routing=routing,
        layers=list(range(layers)),
        stored_bytes=dict.fromkeys(keys, 100 * MB),
        fast_bytes=dict.fromkeys(keys, 100 * MB),
        codecs=dict.fromkeys(keys, "mxfp4"),
        link_bytes=lambda _k: 100 * MB,
        device="cuda",
        clock=clock,
    )


def test_a_layers_misses_are_spread_over_the_cpu_and_the_link() -> None:
    """Eight misses in one prefill layer: one at a time each is cheaper on the CPU, but the CPU's
    queue grows with every one given to it, so some go to the idle link. Without SPLIT: whole
    experts; with it, the first miss already gives the link a share of its rows."""
    clock = ManualClock(10.0)
    planner = _planner(clock)
    planner.policy.split_share = lambda case: 0.0  # type: ignore[method-assign]
    planner.note_routing(0, list(range(8)))
    places = [planner.decide((0, e), 1, staged=False).value for e in range(8)]
    assert places[0] == "host" and places[1] == "host"  # 1.4 ms, then 2.8 ms < a 4 ms copy
    assert "stream" in places and "host" in places
    assert planner.link_free_at > clock.now and planner.host_free_at > clock.now

    planner = _planner(clock)
    planner.note_routing(0, list(range(8)))
    places = [planner.decide((0, e), 1, staged=False).value for e in range(8)]
    assert places[0] == "split"
    assert planner.link_free_at > clock.now and planner.host_free_at > clock.now


def test_a_copy_is_staged_only_when_it_lands_before_the_cpu_could_have_computed_it() -> None:
    clock = ManualClock(10.0)
    planner = _planner(clock, layers=4)
    planner.note_routing(0, [])  # layer 0 starts at 10 s
    planner.layer_s = 2e-3  # a layer takes 2 ms, none has a miss predicted
    # Layer 3 starts at +6 ms: the copy lands at +4 ms, before +6 ms and the CPU's 1.4 ms.
    assert planner.should_stage((3, 5))
    assert planner.arrives[(3, 5)] == clock.now + COPY_S
    # The link is now busy until +4 ms: the next copy would land at +8 ms, too late for layer 3.
    assert not planner.should_stage((3, 6))
    clock.advance(4e-3)  # still in layer 0 (a slow one): layer 3 is no nearer to starting
    assert not planner.should_stage((3, 6))
    planner.note_routing(1, [])  # layer 1 starts at +4 ms: layer 3 at +8 ms
    assert planner.should_stage((3, 6))


def test_when_a_layer_starts_counts_the_host_work_predicted_on_the_way() -> None:
    """A mean layer time staged copies for layers that came sooner (all their experts in tier 1)
    and wasted the link, and skipped ones that would have landed in time before slow layers."""
    clock = ManualClock(10.0)
    planner = _planner(clock, layers=4)
    planner.note_routing(0, [])
    planner.begin_layer(0, [])
    planner.layer_s, planner.host_per_layer = 1e-3, 0.5  # 1 ms with half a host compute on average
    # Layers 1 and 2 use experts in tier 1: 0.3 ms each, as layer 0. Layer 3 starts at +0.9 ms, so a
    # 4 ms copy lands after the CPU (1.4 ms) would have computed its expert.
    planner.expect(1, [0, 1])
    planner.expect(2, [])
    assert abs(planner.starts_at(3, HOST_S) - (clock.now + 0.9e-3)) < 1e-12
    assert not planner.should_stage((3, 5))  # a mean 1 ms layer: +3 ms + 1.4 ms, "in time"
    # Two misses predicted in layers 1 and 2: 1 + 1.5 x 1.4 = 3.1 ms each: layer 3 starts at +6.5 ms.
    planner.expect(1, [4, 5])
    planner.expect(2, [4, 5])
    assert abs(planner.starts_at(3, HOST_S) - (clock.now + 6.5e-3)) < 1e-12
    assert planner.should_stage((3, 5))
    # An expert with a copy staged for it is not a host computation on the way.
    planner.expect(2, [4, 5, 6])
    planner.arrives[(2, 6)] = clock.now + 1e-3
    assert abs(planner.starts_at(3, HOST_S) - (clock.now + 6.5e-3)) < 1e-12


def test_the_staged_wait_is_how_long_until_the_copy_lands() -> None:
    clock = ManualClock(10.0)
    planner = _planner(clock)
    planner.layer_s = 3e-3  # layer 1 starts at +3 ms: a copy landing at +4 ms beats the CPU
    assert planner.should_stage((1, 5))
    case = planner.case((1, 5), 1, staged=True)
    assert case.staged and abs(case.staged_wait_s - COPY_S) < 1e-12
    clock.advance(COPY_S)
    assert planner.case((1, 5), 1, staged=True).staged_wait_s == 0.0


def test_a_staged_copy_nobody_used_is_forgotten_when_its_layer_has_run() -> None:
    """A copy staged for a wrong prediction was never decided, so it stayed in `arrives`: the next
    step's `starts_at` counted that expert as staged, not as a host computation on the way."""
    clock = ManualClock(10.0)
    planner = _planner(clock, layers=4)
    planner.note_routing(0, [])
    planner.begin_layer(0, [])
    planner.layer_s = 3e-3
    planner.expect(2, [5])
    assert planner.should_stage((2, 5)) and planner.should_stage((3, 6))
    planner.begin_layer(1, [])
    assert set(planner.arrives) == {(2, 5), (3, 6)}  # still to come
    planner.begin_layer(2, [4])  # the router chose 4, not 5: nobody takes (2, 5)
    assert set(planner.arrives) == {(2, 5), (3, 6)}  # layer 2's own decisions may still use it
    planner.begin_layer(3, [6])
    assert set(planner.arrives) == {(3, 6)}
    planner.begin_layer(0, [])  # the next step
    assert planner.arrives == {}
    planner.expect(2, [5])
    missing = planner.starts_at(3, HOST_S) - planner.starts_at(2, HOST_S)
    assert missing > planner.layer_s  # (2, 5) is a host computation again


def test_the_staging_room_holds_what_the_link_can_land_in_the_lookahead() -> None:
    """A room for every expert predicted for the next 3 layers (6 Mixtral experts) held back from
    tier 1 what the link could never fill: with 4 ms copies and 1.3 ms layers, the copy the link
    lands in 3 layers and the next layer's two wait at once."""
    clock = ManualClock(10.0)
    planner = _planner(clock, layers=4)
    assert planner.staging_room(3, 2) == 6  # no layer time yet: every predicted expert
    planner.layer_s = 1.3e-3
    assert planner.staging_room(3, 2) == 3  # ceil(3 x 1.3 / 4) + 2
    planner.layer_s = 20e-3
    assert planner.staging_room(3, 2) == 6  # slow layers: capped at every predicted expert
    # A full room stages nothing more, whatever the link could land.
    planner.note_routing(0, [])
    planner.room = 1
    assert planner.should_stage((3, 5))
    planner.link_free_at = clock.now  # the link is free again: only the room is in the way
    assert not planner.should_stage((3, 6))
    planner.decide((3, 5), 1, staged=True)  # its layer used it: the room has space again
    assert planner.should_stage((3, 6))
    # A refit reallocates tier 1's slot pool on a GPU: a room wavering by one stays as it is.
    planner.room = 3
    assert planner.room_settled(4) and planner.room_settled(2) and not planner.room_settled(6)
    planner.room = 12
    assert planner.room_settled(15) and not planner.room_settled(16)


def test_q_star_splits_a_miss_so_that_the_cpu_and_the_link_finish_together() -> None:
    p = _policy()
    case = _case(can_split=True)
    share = p.split_share(case)
    # The CPU's part and the link's part of the rows take the same time.
    cpu = (1 - DOWN_SHARE * share) * HOST_S
    link = DOWN_SHARE * share * COPY_S
    assert share > 0.5 and cpu == pytest.approx(link)
    costs = p.costs(case)
    assert costs[Placement.SPLIT] < costs[Placement.HOST]
    assert p.decide((0, 1), case) is Placement.SPLIT
    # A busy CPU moves more rows to the link (all of them, at most); a busy link fewer, then none.
    assert p.split_share(_case(can_split=True, host_wait_s=1e-3)) == 1.0
    assert p.split_share(_case(can_split=True, link_wait_s=0.8e-3)) < share
    assert p.split_share(_case(can_split=True, link_wait_s=2e-3)) == 0.0
    assert p.decide((0, 2), _case(can_split=True, link_wait_s=2e-3)) is Placement.HOST
    # No option where the planner says so (a CPU-only machine, a staged copy).
    assert Placement.SPLIT not in p.costs(_case())


def test_the_planner_books_a_split_on_the_cpu_and_the_link() -> None:
    clock = ManualClock()
    planner = _planner(clock)
    planner.note_routing(0, [2, 3])
    assert planner.decide((0, 2), 1, staged=False) is Placement.SPLIT
    share = planner.take_split((0, 2))
    assert planner.host_free_at == pytest.approx((1 - DOWN_SHARE * share) * HOST_S)
    assert planner.link_free_at == pytest.approx(DOWN_SHARE * share * COPY_S)
    # The next miss sees both busy: still split, the same balance from where each is.
    second = planner.case((0, 3), 1, staged=False)
    assert second.host_wait_s > 0 and second.link_wait_s > 0
    with pytest.raises(KeyError):
        planner.take_split((0, 2))  # taken once
