"""Which checkpoints to admit and which checkpoints or leaves to evict.

Eviction policies pick one victim from a non-empty candidate list (every candidate is evictable: the
caller filtered out pinned checkpoints and leaves still held by a sequence):
- `LruPolicy`: the least recently used (ties: the oldest id / the shallowest node).
- `FlopAwarePolicy` (Marconi-style): the lowest score, where
      score = recency in [0, 1] (normalised over the candidates) + alpha * efficiency in [0, 1]
      efficiency = FLOPs the item saves / bytes it holds, normalised by the candidates' maximum.
  A checkpoint saves `prefill_flops(step)` and holds one slot plus a frozen block when partial; a leaf
  saves what its deepest checkpoint saves and holds its block plus its checkpoints.
Admission policies answer whether a save is worth reserving.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from hybridcache.cache.checkpoint import Checkpoint
from hybridcache.cache.config import CacheConfig, CostModel
from hybridcache.cache.request import SaveReason
from hybridcache.cache.trie import Node


class LruPolicy:
    def pick_checkpoint(self, candidates: Sequence[Checkpoint]) -> Checkpoint:
        return min(candidates, key=lambda c: (c.last_access, c.ckpt_id))

    def pick_leaf(self, candidates: Sequence[Node]) -> Node:
        return min(candidates, key=lambda n: (_leaf_recency(n), n.depth, n.block_id))


class FlopAwarePolicy:
    def __init__(self, alpha: float, cost: CostModel, block_size: int) -> None:
        self.alpha = alpha
        self.cost = cost
        self.block_size = block_size

    def _checkpoint_bytes(self, ckpt: Checkpoint) -> float:
        frozen = self.block_size * self.cost.kv_bytes_per_token if ckpt.frozen_block is not None else 0.0
        return self.cost.state_bytes + frozen

    def _checkpoint_value(self, ckpt: Checkpoint) -> tuple[float, float]:
        return self.cost.prefill_flops(ckpt.step), self._checkpoint_bytes(ckpt)

    def _leaf_value(self, node: Node) -> tuple[float, float]:
        ckpts = list(node.iter_checkpoints())
        flops = max((self.cost.prefill_flops(c.step) for c in ckpts), default=0.0)
        held = self.block_size * self.cost.kv_bytes_per_token + sum(self._checkpoint_bytes(c) for c in ckpts)
        return flops, held

    def _pick(self, candidates: Sequence, recency: list[float], values: list[tuple[float, float]]):
        lo, hi = min(recency), max(recency)
        span = (hi - lo) or 1.0
        eff = [f / b if b > 0 else 0.0 for f, b in values]
        top = max(eff) or 1.0
        scores = [(t - lo) / span + self.alpha * e / top for t, e in zip(recency, eff, strict=True)]
        best = min(range(len(candidates)), key=lambda i: (scores[i], recency[i], i))
        return candidates[best]

    def pick_checkpoint(self, candidates: Sequence[Checkpoint]) -> Checkpoint:
        return self._pick(
            candidates, [c.last_access for c in candidates], [self._checkpoint_value(c) for c in candidates]
        )

    def pick_leaf(self, candidates: Sequence[Node]) -> Node:
        return self._pick(
            candidates, [_leaf_recency(n) for n in candidates], [self._leaf_value(n) for n in candidates]
        )


def _leaf_recency(node: Node) -> int:
    return max([node.last_access, *(c.last_access for c in node.iter_checkpoints())])


EvictionPolicy = LruPolicy | FlopAwarePolicy


class AdmitAll:
    def admit(self, reason: SaveReason, key: Hashable) -> bool:
        return True


class RepeatBranchAdmission:
    """Admit every save except a branch point whose prefix (`key`) has not been seen as one before.

    Remembers the last `capacity` branch-point keys (bounded memory).
    """

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[Hashable, None] = OrderedDict()

    def admit(self, reason: SaveReason, key: Hashable) -> bool:
        if reason is not SaveReason.BRANCH_POINT:
            return True
        if key in self._seen:
            self._seen.move_to_end(key)
            return True
        self._seen[key] = None
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return False


AdmissionPolicy = AdmitAll | RepeatBranchAdmission


def make_policies(config: CacheConfig, cost: CostModel) -> tuple[EvictionPolicy, AdmissionPolicy]:
    eviction: EvictionPolicy = (
        LruPolicy() if config.eviction == "lru"
        else FlopAwarePolicy(config.flop_aware_alpha, cost, config.block_size)
    )
    admission: AdmissionPolicy = AdmitAll() if config.admission == "all" else RepeatBranchAdmission()
    return eviction, admission
