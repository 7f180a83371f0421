"""Workloads, the cache simulator and the engine benchmark: the numbers that show what the cache is worth.

- `workloads`: real traces (ShareGPT, Mooncake, SWE-agent) and generators (shared-prefix, group-sampling),
  deterministic given a seed, as token-level requests (no torch).
- `cost_model`: bytes per KV token, bytes per state slot and prefill FLOPs of a model's config.json.
- `simulator`: replays a workload through the real `hybridcache.cache.PrefixCache` under each cache policy
  (`hybridcache simulate`); no model, no torch.
- `engine_bench`: runs a workload through the real engine in several cache modes (`hybridcache bench`).
- `plots`: PNG figures of both; `cli`: the two subcommands.

See docs/bench.md.
"""
