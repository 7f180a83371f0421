"""Counters of the prefix cache and their immutable snapshot."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of `PrefixCache.stats`.

    num_queries / num_query_tokens  admitted requests and their prompt tokens (a match that is released
                                    without admission counts nothing).
    num_hits / num_hit_tokens       admitted requests that started from a checkpoint, and the steps skipped.
    hits_by_reason                  hits by the reason of the checkpoint used.
    saves_by_reason                 published checkpoints by reason (finish/preempt adoptions included).
    declined_saves                  saves not made, by cause: 'policy', 'no_room', 'routed_experts',
                                    'unsafe', 'duplicate' (an identical checkpoint existed), 'anchor_full'.
    evictions_by_kind               'checkpoint' (state pressure), 'dead_block', 'frozen_tail', 'leaf',
                                    'leaf_checkpoint' (released with its leaf), 'anchor_cap',
                                    'decode_replaced'.
    num_deduplicated_blocks         computed full blocks that were found in the trie and shared instead.
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
            **sizes,
        )
