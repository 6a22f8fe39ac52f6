"""q* on real routing, off the machine: routing traces replayed through the engine's own tiers
and policy on a modelled machine (issue 33).

- `shapes`: model shapes (layers, experts, top-k, bytes per expert per codec, dense bytes per
  token) from a config.json or a built-in name (`builtin_models`); whether a trace fits one
  (`trace_fit`).
- `profiles`: hardware profiles (links, memory, compute), built in or from a TOML file
  (`profile_toml`: reading one).
- `synthetic`: routing traces with set temporal reuse, popularity skew and cross-layer correlation.
- `stats`: what a trace's routing looks like (reuse, skew, misses of cache policies).
- `machine`: what one routed expert costs on a profile, and the timeline of device/cpu/link/disk.
- `replay`: the engine's own tiers, planner, q* and prefetcher driven over a trace on that machine.
- `mover`: what a replay moves (time on that machine, not bytes) and what it counts.
- `baselines`: llama.cpp's static split, streaming without a cache, Belady-cached streaming.
- `source`: a routing trace walked once per pass, a step at a time, never held whole.
- `caches`: LRU and Belady's optimum fed a step at a time (Belady with its next uses precomputed).
- `bounds`: the bound no policy can beat, counted as the steps stream by.
- `simulator`: `simulate()`, every policy and the bound in one `SimulationReport`.
- `measure`: this machine measured as a profile (`freetoken simulate --profile-here`);
  `measure_overheads`: the engine's own fixed costs measured.
- `engine_costs`: the engine's measured bookkeeping, priced by default for its own policies.
- `published`, `peers`: published runs of real offloading systems as setups, and those systems'
  own expert caches where no policy of `simulate` is theirs.
"""
