"""The q* cost model: per expert per step, RESIDENT, STREAM or HOST, whichever costs least.

Costs in seconds for one expert and T tokens routed to it (DESIGN.md section 5):

    t_resident = t_compute(fast, T)
    t_stream   = t_fetch + wait(link) + link bytes / bw(host->fast) + t_decode(fast) - overlap
                 + t_compute(fast, T) + loss - gain
    t_staged   = wait(staged copy) + t_compute(fast, T)                  (CUDA, a prefetched copy)
    t_host     = t_fetch + wait(cpu) + t_compute(host, T) + activation bytes / bw(activations)
    t_split    = t_fetch + max(wait(cpu) + (1 - d s) t_compute(host, T),
                               wait(link) + d s x tier-1 bytes / bw(host->fast))
                 + 1.5 x activation bytes / bw(activations) + d s t_compute(fast, T)   (CUDA)

The waits (CUDA only, where the link and the CPU work in parallel with the device) are how long
the link and the CPU are still busy with the copies and host computations already decided or
staged (`ExpertPlanner` keeps them): a layer's misses are spread over both instead of queueing on
the one that is cheaper for a single expert. A STAGED expert is computed from the prefetch's copy
in the staging buffer and not kept in the LRU, so it evicts nothing there (tier 1's recent segment
may hold the copy a while: `recent.RecentCopies`); a STREAM of it keeps it (loss - gain).
SPLIT spreads one miss over both: the CPU computes it but for the last share `s` of its down
projection's rows (d = `DOWN_SHARE` of its weights), which the link copies meanwhile (in the form
the CPU computes them in: tier 1's) and the device computes (`routed.expert_forward_split`); `s`
makes the two finish together (`split_share`), so a link whose copy of a whole expert takes 3x
the CPU's compute of it still takes up to a quarter of that compute off the CPU. Nothing is kept.

`t_fetch` = stored bytes / bw(storage->host) when the block is not in tier 2 (else 0); link bytes
are what the copy moves (CUDA: the compact raw bytes, which the GPU then decodes in t_decode,
measured per codec); `overlap` is the part of the copy a prefetch already hid. Residency is
valued by expected future uses, the decayed routing frequency f: each later use of a resident
expert saves `min(s, reload)` with `s = max(0, t_compute(host, 1) - t_compute(fast, 1))` (a
decode step on the host instead of tier 1) and `reload` = what bringing it back costs (copy +
host-tier miss rate x fetch). `gain = f_candidate x min(s, reload_candidate)`, `loss = sum over
the victims a STREAM must evict of f_v x min(s, reload_v)`, plus, when there are victims, a
margin of `SWAP_MARGIN_SD` standard deviations of the frequencies' noise, sqrt((f_candidate +
sum f_v) / 2), times min(s, reload_candidate). So a STREAM that only pushes out an equally hot
expert is not worth its copy (no LRU thrashing when one step's experts exceed tier 1, no swaps
on chance differences), and a hot expert displaces a cold one.

Compute times are measured online: an EMA per (device, codec, tokens bucket) where the bucket is
the power of two at or above T. Until a bucket has a measurement, the nearest measured bucket of
the same (device, codec) is scaled linearly in T for T above it (compute-bound) and used as is
below (weight-read bound); with nothing measured, `prior_seconds` answers.
On a CPU-only machine "fast" is matmul on decoded tier-1 tensors and "host" is decode-into-a-
scratch-buffer + matmul; the host->fast link is the decode (its oracle times decodes).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from .oracle import BandwidthOracle

logger = logging.getLogger(__name__)


class Placement(str, Enum):
    """Where one expert computes this step."""

    RESIDENT = "resident"  # weights in tier 1: compute there
    STREAM = "stream"  # copy tier 2/3 -> tier 1 (cached there), compute there
    STAGED = "staged"  # compute from a prefetch's staged copy on the device, not kept in the LRU
    HOST = "host"  # compute where the weights are (host), move only activations
    SPLIT = "split"  # CUDA: HOST, but the down projection's last rows copied to and run on the device


DOWN_SHARE = 1 / 3
"""The down projection's share of an expert's weights: [H, I] of gate [I, H], up [I, H] and down
(every gated MoE MLP the engine runs; biases are a rounding error). A SPLIT moves and computes a
share of it, so the CPU's work shrinks by at most this much."""
MIN_SPLIT_SHARE = 0.05  # a smaller device share saves less than its extra transfers cost
SWAP_MARGIN_SD = 1.0
"""How many standard deviations of noise a STREAM that evicts must win by. The decayed routing
frequency f that values residency is a count of uses at some rate p per step, decayed by d: its
variance is p(1 - p) / (1 - d^2) = f (1 - p) / (1 + d), about f / 2 at the engine's decay (0.99)
and the rates of a cache's contested experts. So candidate and victims that are used alike differ
by ~sqrt((f_c + sum f_v) / 2) by chance, and a swap on such a difference buys nothing but its
copy. Replayed on the calibrated synthetic traces (`freetoken simulate`, MXFP4, RTX 4090, 50% of
the expert bytes, started from the routing profile), q* swapped 612 times over Mixtral-8x7B's 577
tokens with no fewer misses than none (29.63 a token against 29.60 with no swap at all); at one
standard deviation 125 swaps, 29.51 misses and 27.38 -> 27.99 tok/s (Qwen3-30B-A3B 158.7 ->
160.3). At 2: Mixtral 28.04 but 1-2% lower with no profile, where the first swaps are what
replace tier 1's experts filled at load by the used ones."""


_RESIDENT = Placement.RESIDENT.value
_TIE_ORDER = {p: i for i, p in enumerate(Placement)}  # equal costs: the first placement listed
_PHASE_KEY = {  # (one token, placement) -> its `decisions_by_phase` key
    (decode, p): f"{'decode' if decode else 'prefill'}/{p.value}"
    for decode in (True, False)
    for p in Placement
}


def tokens_bucket(tokens: int) -> int:
    """The power of two >= tokens (1, 2, 4, ...)."""
    return 1 << (max(1, tokens) - 1).bit_length()


class ComputeCostModel:
    """EMA of measured compute seconds per (device, codec, tokens bucket).

    `observe` normalises a measurement at T tokens to its bucket size (linear in T inside a
    bucket) so that measurements at different T of the same bucket agree.
    """

    def __init__(self, alpha: float = 0.2, prior_seconds: float = 1e-3) -> None:
        self.alpha, self.prior_seconds = alpha, prior_seconds
        self._ema: dict[tuple[str, str, int], float] = {}
        # (device, codec) -> its measured buckets, ascending: the fallback of `measured` reads it
        # instead of scanning every entry (it runs several times per q* decision; a codec never
        # measured, such as an MXFP4 device decode that never happens, scanned them each time).
        self._buckets: dict[tuple[str, str], list[int]] = {}

    def _put(self, device: str, codec: str, bucket: int, seconds: float) -> None:
        if (device, codec, bucket) not in self._ema:
            buckets = self._buckets.setdefault((device, codec), [])
            buckets.append(bucket)
            buckets.sort()
        self._ema[(device, codec, bucket)] = seconds

    def observe(self, device: str, codec: str, tokens: int, seconds: float, times: int = 1) -> None:
        """Fold in a measurement of `seconds` at `tokens` tokens, `times` times over (a layer's
        experts timed together, each credited an equal share: one call, not one per expert)."""
        b = 1 if tokens <= 1 else tokens_bucket(tokens)
        value = seconds * b / max(1, tokens)
        key = (device, codec, b)
        old = self._ema.get(key)
        if old is None:
            self._put(device, codec, b, value)
            times -= 1
            old = value
        keep, alpha = 1 - self.alpha, self.alpha
        for _ in range(times):
            old = keep * old + alpha * value
        self._ema[key] = old

    def set(self, device: str, codec: str, tokens: int, seconds: float) -> None:
        """Set a bucket directly (tests, calibration)."""
        self._put(device, codec, tokens_bucket(tokens), seconds)

    def estimate(self, device: str, codec: str, tokens: int) -> float:
        known = self.measured(device, codec, tokens)
        return self.prior_seconds * max(1, tokens) if known is None else known

    def measured(self, device: str, codec: str, tokens: int) -> float | None:
        """`estimate` from measurements only: None while (device, codec) has none."""
        b = 1 if tokens <= 1 else tokens_bucket(tokens)
        exact = self._ema.get((device, codec, b))
        if exact is not None:
            return exact
        measured = self._buckets.get((device, codec))
        if not measured:
            return None
        below = [m for m in measured if m <= b]
        if below:
            m = below[-1]
            return self._ema[(device, codec, m)] * b / m
        return self._ema[(device, codec, measured[0])]

    def snapshot(self) -> dict[str, float]:
        return {f"{d}/{c}/T<={b}": v for (d, c, b), v in sorted(self._ema.items())}


@dataclass(slots=True)  # built for every decision: a frozen one took 4x as long (2.3 us)
class ExpertCase:
    """What the policy needs to know about one expert this step.

    `stored_bytes`: bytes of its FTW block (tier 3 form, what a disk read moves); `link_bytes`:
    what a STREAM copies host -> fast (default `stored_bytes`; CUDA: the raw compact bytes) and
    `decode_s` the fast side's measured decode of them; `fast_bytes`: its tier-1 size;
    `activation_bytes`: bytes of its input + output activations (HOST moves them);
    `prefetched_s`: seconds of copy a prefetch already hid (0 if none); `victims`: reload times
    (s) and decayed frequencies of what a STREAM would evict; `frequency`: its own.
    CUDA, where the link and the CPU work beside each other: `staged` (a prefetch copied it into
    the staging buffer on the device; `staged_wait_s` until that copy lands), `link_wait_s` (until
    the link is free for a new copy) and `host_wait_s` (until the CPU is free for its compute).
    `can_split`: SPLIT is an option (CUDA, not staged; `QStarPolicy.split_share`).
    """

    tokens: int
    codec: str
    resident: bool
    in_host: bool
    stored_bytes: int
    fast_bytes: int
    activation_bytes: int = 0
    link_bytes: int | None = None
    decode_s: float = 0.0
    prefetched_s: float = 0.0
    frequency: float = 0.0
    victims: Sequence[tuple[float, float]] = ()
    can_stream: bool = True
    free_room: bool = False  # tier 1 can take it without evicting anything
    host_miss: float = 0.0  # measured probability that an expert not in tier 1 misses tier 2
    staged: bool = False
    staged_wait_s: float = 0.0
    link_wait_s: float = 0.0
    host_wait_s: float = 0.0
    can_split: bool = False  # CUDA, not staged: SPLIT is an option


class QStarPolicy:
    """Chooses a Placement per expert per step from measured compute and oracle bandwidth.

    Links: `storage` (tier 3 -> tier 2), `host_fast` (tier 2 -> tier 1), `activations` (moving
    hidden states to the host and back; on CPU-only nothing moves and it is None).
    `fast_device` / `host_device`: the device names compute is measured under.
    """

    def __init__(
        self,
        storage: BandwidthOracle,
        host_fast: BandwidthOracle,
        activations: BandwidthOracle | None = None,
        compute: ComputeCostModel | None = None,
        *,
        fast_device: str = "fast",
        host_device: str = "host",
    ) -> None:
        self.storage, self.host_fast, self.activations = storage, host_fast, activations
        self.compute = compute or ComputeCostModel()
        self.fast_device, self.host_device = fast_device, host_device
        self.decisions: Counter[str] = Counter()
        self.decisions_by_phase: Counter[str] = Counter()

    def costs(self, case: ExpertCase) -> dict[Placement, float]:
        """Predicted seconds of each feasible placement."""
        estimate = self.compute.estimate
        t_fast = estimate(self.fast_device, "decoded", case.tokens)
        if case.resident:
            return {Placement.RESIDENT: t_fast}
        compute = estimate(self.host_device, case.codec, case.tokens)  # HOST's (one estimate each)
        fetch = 0.0 if case.in_host else self.storage.seconds_for(case.stored_bytes)
        out: dict[Placement, float] = {}
        if case.can_stream:
            moved = case.stored_bytes if case.link_bytes is None else case.link_bytes
            full_copy = self.host_fast.seconds_for(moved) + case.decode_s
            copy = max(0.0, full_copy - case.prefetched_s)
            wait = case.staged_wait_s if case.staged else (case.link_wait_s if copy > 0 else 0.0)
            one = case.tokens == 1
            saving = max(
                0.0,
                (compute if one else estimate(self.host_device, case.codec, 1))
                - (t_fast if one else estimate(self.fast_device, "decoded", 1)),
            )
            reload = full_copy + case.host_miss * self.storage.seconds_for(case.stored_bytes)
            gain = case.frequency * min(saving, reload)
            loss = sum(vf * min(saving, vr) for vr, vf in case.victims)
            if case.victims:  # a swap must win by more than the estimates' noise
                noise = math.sqrt((case.frequency + sum(vf for _, vf in case.victims)) / 2)
                loss += SWAP_MARGIN_SD * noise * min(saving, reload)
            out[Placement.STREAM] = fetch + wait + copy + t_fast + loss - gain
        if case.staged:  # use the staged copy and let it go: nothing evicted, nothing gained
            out[Placement.STAGED] = case.staged_wait_s + t_fast
        act = 0.0
        if self.activations is not None and case.activation_bytes:
            act = self.activations.seconds_for(case.activation_bytes)
        out[Placement.HOST] = fetch + case.host_wait_s + compute + act
        share = self.split_share(case)
        if share:
            rows_copy = self.host_fast.seconds_for(int(DOWN_SHARE * share * case.fast_bytes))
            out[Placement.SPLIT] = (
                fetch
                + max(case.host_wait_s + (1 - DOWN_SHARE * share) * compute, case.link_wait_s + rows_copy)
                + 1.5 * act  # the hidden state to the CPU, its output back, and the down input across
                + DOWN_SHARE * share * t_fast
            )
        return out

    def split_share(self, case: ExpertCase) -> float:
        """SPLIT: the share of the down projection's rows the device computes, so that the CPU
        (after what it is busy with) and the link (after its copies) finish together; 0 when SPLIT
        is no option or the share would be under `MIN_SPLIT_SHARE`."""
        if not case.can_split:
            return 0.0
        compute = self.compute.estimate(self.host_device, case.codec, case.tokens)
        down_copy = self.host_fast.seconds_for(int(DOWN_SHARE * case.fast_bytes))  # every row
        # host_wait + (1 - d s) compute = link_wait + s down_copy
        share = (case.host_wait_s + compute - case.link_wait_s) / (DOWN_SHARE * compute + down_copy)
        share = min(1.0, share)
        return share if share >= MIN_SPLIT_SHARE and math.isfinite(share) else 0.0

    def count_resident(self, experts: int, tokens: int) -> None:
        """Record `experts` RESIDENT placements without pricing them: for an expert in tier 1
        `costs` has RESIDENT only, so `decide` would return it (the hot path skips the call)."""
        self.decisions[_RESIDENT] += experts
        self.decisions_by_phase[_PHASE_KEY[tokens == 1, Placement.RESIDENT]] += experts

    def decide(self, key: tuple[int, int], case: ExpertCase) -> Placement:
        """The cheapest placement (ties: RESIDENT, STREAM, STAGED, HOST, SPLIT); counted, logged at
        debug."""
        costs = self.costs(case)
        if case.free_room and Placement.STREAM in costs and not self._link_queue_in_the_way(case):
            # Free fast memory is never better left empty: fill it (this also seeds the
            # fast-compute measurements the later, contested decisions need).
            choice = Placement.STREAM
        elif case.tokens == 1 and self.compute.measured(self.host_device, case.codec, 1) is None:
            # Never measured, the host's cost is the prior's guess; a policy that trusts it may
            # never compute there and so never learn better. One decode token is cheap anywhere:
            # try it once and price the host from then on by what it measured.
            choice = Placement.HOST
        else:
            choice = min(costs, key=lambda p: (costs[p], _TIE_ORDER[p]))
        self.decisions[choice.value] += 1
        self.decisions_by_phase[_PHASE_KEY[case.tokens == 1, choice]] += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "q* %s T=%d -> %s (%s)",
                key,
                case.tokens,
                choice.value,
                ", ".join(f"{p.value}={c * 1e3:.3f}ms" for p, c in costs.items()),
            )
        return choice

    def _link_queue_in_the_way(self, case: ExpertCase) -> bool:
        """Whether filling free room would queue the layer behind copies already on the link (once
        the device's compute is measured): the costs decide then. A cold tier 1 filled by demand
        copies whatever the queue made the simulated Qwen3-30B / RTX 4090 / 50% run its first 30
        tokens at 66 tok/s, each fill waiting ~0.75 ms for the link (100 tok/s when the costs
        decide; the steady state is the same)."""
        return case.link_wait_s > 0 and self.compute.measured(self.fast_device, "decoded", 1) is not None

    def stats(self) -> dict[str, object]:
        return {
            "decisions": dict(self.decisions),
            "decisions_by_phase": dict(self.decisions_by_phase),
            "compute_ema_s": self.compute.snapshot(),
        }


class AlwaysStreamPolicy(QStarPolicy):
    """Baseline policy: RESIDENT when in tier 1, else STREAM (HOST only when the expert cannot fit
    tier 1 at all). What an LRU expert cache without a cost model does (mixtral-offloading)."""

    def decide(self, key: tuple[int, int], case: ExpertCase) -> Placement:
        if case.resident:  # not reached from the provider, which counts residents in bulk
            choice = Placement.RESIDENT
        elif case.can_stream:
            choice = Placement.STREAM
        else:
            choice = Placement.HOST
        self.decisions[choice.value] += 1
        phase = "decode" if case.tokens == 1 else "prefill"
        self.decisions_by_phase[f"{phase}/{choice.value}"] += 1
        return choice
