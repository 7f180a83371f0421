"""The simulated policies (`PolicySpec`, parsed from `--policies` by `parse_policies`) and the memory they run in
(`SimConfig`; `cache_sizing` for the engines with a separate pool of state slots, `check_simulable` for the
simulator's own limit). No cache here: replay.py builds one from a spec and a config.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hybridcache.engine.cost_model import ModelCost

POLICY_NAMES = ("none", "block-aligned", "seed", "hybridcache", "hybridcache+flop", "oracle", "bounded-oracle",
                "hybridcache+all", "reuse-oracle")
DEFAULT_POLICIES = POLICY_NAMES[:-3]
# the policies that run the `hybridcache` cache mode, with KV and states in one pool of blocks
_HYBRID_POLICIES = ("hybridcache", "hybridcache+flop", "bounded-oracle", "hybridcache+all", "reuse-oracle")
GIB = 1 << 30
# blocks one simulated cache may hold (device + host): its pool keeps a list entry per block (8 bytes)
MAX_SIM_BLOCKS = 1 << 26


@dataclass(frozen=True)
class PolicySpec:
    """One simulated policy: `name` as reported, the cache `mode` of save_plan.py (or `none` / `oracle`),
    the eviction policy and the block size it runs with."""

    name: str
    mode: str
    block_size: int
    eviction: str = "lru"
    admission: str | None = None  # the cache's admission policy; None: the mode's

    @property
    def base(self) -> str:
        """The policy's name without its block size (`block-aligned:528` -> `block-aligned`)."""
        return self.name.partition(":")[0]

    @property
    def one_budget(self) -> bool:
        """KV blocks and checkpoint states share one pool (`CacheConfig.state_pages`), as in the engine."""
        return self.mode == "hybridcache"


def parse_policies(text: str | Iterable[str], block_size: int) -> list[PolicySpec]:
    """`"none,block-aligned:528,hybridcache"` -> specs; `NAME:B` overrides the block size of one policy."""
    names = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    if not names:
        raise ValueError(f"no policy given; choose from {', '.join(POLICY_NAMES)}")
    specs = []
    for name in names:
        base, _, size = name.partition(":")
        if base not in POLICY_NAMES:
            raise ValueError(f"unknown policy {base!r}; choose from {', '.join(POLICY_NAMES)} (NAME:BLOCK_SIZE)")
        mode = "hybridcache" if base in _HYBRID_POLICIES else base
        eviction = "flop_aware" if base == "hybridcache+flop" else "lru"
        admission = "all" if base == "hybridcache+all" else None
        if size and not (size.isdigit() and int(size) >= 1):
            raise ValueError(f"policy {name!r}: the block size after ':' must be an integer >= 1, got {size!r}")
        specs.append(PolicySpec(name, mode, int(size) if size else block_size, eviction, admission))
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"policies repeat: {names}")
    return specs


@dataclass(frozen=True)
class SimConfig:
    """Memory budget (bytes, KV + checkpoint states), default block size, chunk budget, slot sizing, and the host
    tier behind the budget: `host_memory_bytes` of host blocks (0: none) for the policies that run the engine's
    cache (`CacheReplay.uses_host_tier`; not the oracles), whose promotions pay when a copy at `host_bandwidth`
    bytes/s (inf: free) takes no longer than recomputing at `device_flops` FLOP/s (`CostModel.promotion_pays`)."""

    memory_bytes: int
    block_size: int = 64
    chunk_budget: int = 8192
    kv_tokens_per_slot: int = 2048
    check_integrity: bool = False
    host_memory_bytes: int = 0
    host_bandwidth: float = float("inf")
    device_flops: float = 4e14


def cache_sizing(memory_bytes: int, cost: ModelCost, block_size: int, kv_tokens_per_slot: int) -> tuple[int, int]:
    """(num_blocks, num_checkpoint_slots) that fit `memory_bytes` in an engine with a separate pool of state slots
    (the `block-aligned` and `seed` policies model such engines; hybridcache's own keeps one pool,
    `PolicySpec.one_budget`): one state slot per `kv_tokens_per_slot` KV tokens, bought in pairs. Example: 1 GiB of
    the built-in model (1,024 B per KV token, 117,248 B per slot with its last hidden state), B = 64, 2,048 tokens
    per slot: a pair is 117,248 + 32 blocks x 65,536 = 2,214,400 B: 484 slots, then (2^30 - 484 x 117,248) //
    65,536 = 15,518 blocks."""
    block_bytes = cost.block_bytes(block_size)
    pair = cost.state_bytes + block_bytes * kv_tokens_per_slot // block_size
    num_slots = int(memory_bytes // pair)
    num_blocks = int((memory_bytes - num_slots * cost.state_bytes) // block_bytes)
    if num_blocks < 1 or num_slots < 1:
        raise ValueError(f"a budget of {memory_bytes / GIB:.3g} GiB holds {num_blocks} blocks and {num_slots} slots")
    return num_blocks, num_slots


def check_simulable(num_blocks: int, host_blocks: int, spec: PolicySpec) -> None:
    """A ValueError when a cache of `num_blocks` device and `host_blocks` host blocks is beyond what the simulator
    holds (`MAX_SIM_BLOCKS`: its pools keep a list entry per block; 2^26 blocks are 4 TiB of 64 KiB blocks)."""
    for what, count in (("--memory-gib", num_blocks), ("--host-memory-gib", host_blocks)):
        if count > MAX_SIM_BLOCKS:
            raise ValueError(f"{what} makes {count:,} blocks of {spec.block_size} tokens; the simulator "
                             f"holds at most {MAX_SIM_BLOCKS:,} (a list entry per block): give less memory or a "
                             "larger block size")
