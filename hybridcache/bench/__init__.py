"""Workloads, the cache simulator and the engine benchmark: the numbers that show what the cache is worth.

- `workloads`: real traces (ShareGPT, Mooncake, SWE-agent) and generators (shared-prefix, group-sampling),
  deterministic given a seed, as token-level requests (no torch).
- `simulator`: replays a workload through the real `hybridcache.cache.PrefixCache` under each cache policy
  (`hybridcache simulate`; the model's sizes and FLOPs from `hybridcache.engine.cost_model`); no model, no torch.
  Its parts: `specs` (the policies and budgets), `replay` (one policy's cache), `forked` (n > 1 completions that
  share a prompt in flight), `results` (counters and reports), `oracles` (the yardsticks), `routing` (replicas
  behind a router).
- `engine_bench`: runs a workload through the real engine in several cache modes (`hybridcache bench`);
  `server_bench`: the same against a running server.
- `plots`: PNG figures of both; `cli`: the two subcommands.

See docs/bench.md.
"""
