"""Counters of the prefix cache, their immutable snapshot, and the enums that name what they count."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field


class EvictionKind(enum.Enum):
    """Why something cached was released to make room (counted in `CacheStats.evictions_by_kind`)."""

    CHECKPOINT = "checkpoint"  # state pressure: an unpinned published checkpoint gave back its slot
    SHADOWED = "shadowed"  # any pressure: a shadowed checkpoint (a deeper one of its chain exists) went first
    DEAD_BLOCK = "dead_block"  # KV pressure: a leaf with no checkpoint and no holder but the trie
    FROZEN_TAIL = "frozen_tail"  # KV pressure: a partial checkpoint gave back its slot and frozen block
    LEAF = "leaf"  # KV pressure: a leaf chosen by the policy (its checkpoints go with it)
    LEAF_CHECKPOINT = "leaf_checkpoint"  # a checkpoint released with its LEAF
    ANCHOR_CAP = "anchor_cap"  # a publish on an anchor at `max_checkpoints_per_anchor` pushed it out
    DECODE_REPLACED = "decode_replaced"  # a newer decode-interval checkpoint of the same sequence replaced it


class DeclineCause(enum.Enum):
    """Why a save was not made (counted in `CacheStats.declined_saves`)."""

    POLICY = "policy"  # the admission policy said no
    NO_ROOM = "no_room"  # no slot (or frozen block) could be reclaimed
    ROUTED_EXPERTS = "routed_experts"  # a partial tail without the routed-expert history the request wants
    UNSAFE = "unsafe"  # the step falls inside a multimodal span
    DUPLICATE = "duplicate"  # an identical checkpoint exists (or one is already reserved at that step)
    ANCHOR_FULL = "anchor_full"  # the anchor is at its cap and every checkpoint on it is pinned


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of `PrefixCache.stats`.

    num_queries / num_query_tokens  admitted requests and their prompt tokens (a match that is released
                                    without admission counts nothing).
    num_hits / num_hit_tokens       admitted requests that started from a checkpoint, and the steps skipped.
    hits_by_reason                  hits by the reason of the checkpoint used.
    saves_by_reason                 published checkpoints by reason (finish/preempt adoptions included).
    declined_saves                  saves not made, by `DeclineCause.value` ('policy', 'no_room', ...).
    evictions_by_kind               releases to make room, by `EvictionKind.value` ('checkpoint', ...).
    num_deduplicated_blocks         computed full blocks that were found in the trie and shared instead.
    Host tier (`CacheConfig.host_blocks`; all 0 without one):
    num_host_hits / num_host_hit_tokens   hits whose checkpoint came from the host tier (among `num_hits`).
    num_promoted_checkpoints / _blocks    checkpoints / trie nodes copied back to the device by a hit.
    num_demoted_checkpoints / _blocks     checkpoints / trie nodes that device eviction moved to the host.
    num_promotions_skipped                admitted requests whose deeper host hit was not worth its copy
                                          (`CostModel.promotion_pays`): they started from the device's hit.
    num_host_dropped                      host checkpoints dropped (host eviction, or a device copy replaced
                                          them): gone.
    num_host_blocks_used, num_host_checkpoints, num_host_nodes   what the host tier holds now.
    """

    num_queries: int = 0
    num_query_tokens: int = 0
    num_hits: int = 0
    num_hit_tokens: int = 0
    hits_by_reason: dict[str, int] = field(default_factory=dict)
    saves_by_reason: dict[str, int] = field(default_factory=dict)
    declined_saves: dict[str, int] = field(default_factory=dict)
    evictions_by_kind: dict[str, int] = field(default_factory=dict)
    num_deduplicated_blocks: int = 0
    num_blocks_used: int = 0
    num_slots_used: int = 0
    num_checkpoints: int = 0
    num_nodes: int = 0
    num_running: int = 0
    num_host_hits: int = 0
    num_host_hit_tokens: int = 0
    num_promoted_checkpoints: int = 0
    num_promoted_blocks: int = 0
    num_demoted_checkpoints: int = 0
    num_demoted_blocks: int = 0
    num_promotions_skipped: int = 0
    num_host_dropped: int = 0
    num_host_blocks_used: int = 0
    num_host_checkpoints: int = 0
    num_host_nodes: int = 0

    @property
    def hit_rate(self) -> float:
        """Fraction of admitted prompt tokens that were skipped."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class StatsCounter:
    """The mutable counters behind `CacheStats` (owned by one cache)."""

    def __init__(self) -> None:
        self.num_queries = 0
        self.num_query_tokens = 0
        self.num_hits = 0
        self.num_hit_tokens = 0
        self.hits_by_reason: Counter[str] = Counter()
        self.saves_by_reason: Counter[str] = Counter()
        self.declined_saves: Counter[str] = Counter()
        self.evictions_by_kind: Counter[str] = Counter()
        self.num_deduplicated_blocks = 0
        self.num_host_hits = 0
        self.num_host_hit_tokens = 0
        self.num_promoted_checkpoints = 0
        self.num_promoted_blocks = 0
        self.num_demoted_checkpoints = 0
        self.num_demoted_blocks = 0
        self.num_promotions_skipped = 0

    def evicted(self, kind: EvictionKind) -> None:
        self.evictions_by_kind[kind.value] += 1

    def declined(self, cause: DeclineCause) -> None:
        self.declined_saves[cause.value] += 1

    def snapshot(self, **sizes: int) -> CacheStats:
        return CacheStats(
            num_queries=self.num_queries,
            num_query_tokens=self.num_query_tokens,
            num_hits=self.num_hits,
            num_hit_tokens=self.num_hit_tokens,
            hits_by_reason=dict(self.hits_by_reason),
            saves_by_reason=dict(self.saves_by_reason),
            declined_saves=dict(self.declined_saves),
            evictions_by_kind=dict(self.evictions_by_kind),
            num_deduplicated_blocks=self.num_deduplicated_blocks,
            num_host_hits=self.num_host_hits,
            num_host_hit_tokens=self.num_host_hit_tokens,
            num_promoted_checkpoints=self.num_promoted_checkpoints,
            num_promoted_blocks=self.num_promoted_blocks,
            num_demoted_checkpoints=self.num_demoted_checkpoints,
            num_demoted_blocks=self.num_demoted_blocks,
            num_promotions_skipped=self.num_promotions_skipped,
            **sizes,
        )
