"""Other systems' expert caches, replayed where they differ from every policy `simulate` runs: what
`published.py` needs to predict a published run with the mechanism that system really has.

`replay_swap_cache`: mixtral-offloading's `ExpertCache` (dvmazur/mixtral-offloading
``src/expert_cache.py``; the copy efeslab/fiddler benchmarked on an RTX A6000 is
``benchmarks/mixtral_offloading/src/expert_cache.py``), as it runs one decode token:

- each MoE layer is an eviction group of `slots` experts on the GPU (``main_size`` / layers), the
  rest in pinned host storage (``offloaded_storages``: ``UntypedStorage(...).pin_memory()``);
- ``load_experts`` marks every routed expert used (a hit moves to the group's most recent end),
  yields the experts already on the GPU first, then swaps each offloaded one, in ascending expert
  order (``unique()`` sorts; the sort by ``offloaded`` is stable), with the group's least recently
  used expert: a routed expert just computed can be the one evicted;
- ``_swap`` copies the loaded expert host -> device AND the evicted one device -> host into a
  pinned buffer (``offloaded_storage_buffer.copy_(main_modules[...].storage, non_blocking=True)``):
  the host copy is rewritten although its weights never changed, so a miss moves its bytes twice;
- every copy and every expert's compute is issued on the one current CUDA stream, so nothing
  overlaps: a layer takes its dense part, then per routed expert (two copies if it missed) and its
  compute, one after the other. (``non_blocking`` frees the host thread, not the stream.)

The copy back runs at the link's rate (`ExpertCosts.link_s`: PCIe moves as much each way).
Prefetching, which the project's README lists as work in progress, is not there: no copy starts
before its layer's routing is known.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from ..memory.routing_trace import Step
from .machine import ExpertCosts
from .mover import Tally


def replay_swap_cache(
    steps: Iterable[Step],
    layers: Sequence[int],
    costs: ExpertCosts,
    *,
    num_experts: int,
    slots: int,
    write_back: bool = True,
) -> Tally:
    """mixtral-offloading's per-layer swap cache of `slots` experts a layer (module docstring) over
    `steps`: the tally of the decode steps. `write_back`: a swap copies the evicted expert back to
    the host (the published code does). The GPU holds the last `slots` experts of each layer at the
    start, as ``build_model`` offloads the first ``offload_per_layer`` of each."""
    if not 1 <= slots <= num_experts:
        raise ValueError(f"slots must be 1 to {num_experts}, got {slots}")
    copies = 2 if write_back else 1
    groups = {layer: OrderedDict.fromkeys(range(num_experts - slots, num_experts)) for layer in layers}
    tally, now = Tally(), 0.0
    for step in steps:
        start, misses = now, 0
        for layer in layers:
            routed = step.layers.get(layer, {})
            group = groups[layer]
            now += costs.dense_s(step.tokens)
            used = sorted(routed)
            for e in used:  # `mark_used`: hits move to the recent end
                if e in group:
                    group.move_to_end(e)
            for e in [e for e in used if e in group] + [e for e in used if e not in group]:
                if e not in group:
                    group.popitem(last=False)  # the least recently used, maybe one just computed
                    group[e] = None
                    now += copies * costs.link_s
                    misses += 1
                now += costs.fast_compute_s(routed[e])
        if step.phase != "decode":
            continue
        tally.tokens += step.tokens
        tally.seconds += now - start
        tally.fast_misses += misses
        tally.bytes["host->fast"] += misses * costs.stored_bytes
        if write_back:
            tally.bytes["fast->host"] += misses * costs.stored_bytes
    return tally
