"""Which checkpoints to admit and which checkpoints or leaves to evict.

Eviction policies are strategies: subclasses of `EvictionPolicy`, registered by name in `EVICTION_POLICIES`
(`@register_eviction("name")`; `CacheConfig.eviction` names one, `make_eviction_policy` builds it). A policy
picks one victim from a non-empty candidate list (every candidate is evictable: the caller filtered out pinned
checkpoints and leaves still held by a sequence); it may also give `Evictor` a fast path over its indexes
(`pick_from_order`, `pick_live_leaf`; by default a full scan through `pick_checkpoint` / `pick_leaf`):
- `LruPolicy`: the least recently used (ties: the oldest id / the shallowest node).
- `FlopAwarePolicy` (Marconi-style): the lowest score, where
      score = recency in [0, 1] (normalised over the candidates) + alpha * efficiency in [0, 1]
      efficiency = FLOPs the item saves / bytes it holds, normalised by the candidates' maximum.
  A checkpoint saves `prefill_flops(step)` and holds one slot plus a frozen block when partial; a leaf
  saves what its deepest checkpoint saves and holds its block plus its checkpoints.
Admission policies answer whether a save is worth reserving (`PrefixCache._decline_cause` asks them).
`Evictor` (evictor.py) applies an eviction policy through its indexes; docs/cache.md says how to add one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence

from hybridcache.cache.checkpoint import Checkpoint
from hybridcache.cache.config import CacheConfig, CostModel
from hybridcache.cache.eviction_index import LeafHeap, RecencyOrder
from hybridcache.cache.request import SaveReason
from hybridcache.cache.trie import Node


class EvictionPolicy:
    """The strategy `Evictor` applies. Subclasses implement `pick_checkpoint` and `pick_leaf`; the rest has
    defaults that are correct for any policy.

    track_steps   the recency orders also index checkpoints by step (`RecencyOrder.max_step`, for FLOP-aware)
    orders_kinds  the policy orders checkpoints against leaves itself (`prefer_checkpoint`) and shadowed
                  checkpoints get no precedence (the bounded oracle's); otherwise leaves go before checkpoints
    """

    track_steps = False
    orders_kinds = False

    @classmethod
    def from_config(cls, config: CacheConfig, cost: CostModel) -> EvictionPolicy:
        """The policy a cache of `config` uses (`make_eviction_policy`)."""
        return cls()

    def pick_checkpoint(self, candidates: Sequence[Checkpoint]) -> Checkpoint:
        raise NotImplementedError

    def pick_leaf(self, candidates: Sequence[Node]) -> Node:
        raise NotImplementedError

    def prefer_checkpoint(self, ckpt: Checkpoint, leaf: Node) -> bool:
        """With `orders_kinds`: whether `ckpt` goes before `leaf` under one byte budget."""
        raise NotImplementedError

    def pick_from_order(self, order: RecencyOrder) -> Checkpoint | None:
        """The victim among the unpinned checkpoints of `order` (None: there is none); default: a full scan."""
        unpinned = [c for c in order.oldest_first() if c.num_pins == 0]
        return self.pick_checkpoint(unpinned) if unpinned else None

    def pick_live_leaf(self, heap: LeafHeap, leaves: Iterable[Node], evictable: Callable[[Node], bool]) -> Node | None:
        """The victim among the evictable live leaves (`heap`: them in LRU order); default: a full scan."""
        live = [n for n in leaves if evictable(n)]
        return self.pick_leaf(live) if live else None


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {}


def register_eviction(name: str) -> Callable[[type[EvictionPolicy]], type[EvictionPolicy]]:
    """Class decorator: register an eviction policy under `name` (`CacheConfig.eviction`)."""

    def add(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        if name in EVICTION_POLICIES and EVICTION_POLICIES[name] is not cls:
            raise ValueError(f"eviction policy {name!r} is already registered")
        EVICTION_POLICIES[name] = cls
        return cls

    return add


@register_eviction("lru")
class LruPolicy(EvictionPolicy):
    def pick_checkpoint(self, candidates: Sequence[Checkpoint]) -> Checkpoint:
        return min(candidates, key=lambda c: (c.last_access, c.ckpt_id))

    def pick_leaf(self, candidates: Sequence[Node]) -> Node:
        return min(candidates, key=lambda n: (_leaf_recency(n), n.depth, n.block_id))

    def pick_from_order(self, order: RecencyOrder) -> Checkpoint | None:
        return order.first_unpinned()

    def pick_live_leaf(self, heap: LeafHeap, leaves: Iterable[Node], evictable: Callable[[Node], bool]) -> Node | None:
        return heap.pick(evictable)


@register_eviction("flop_aware")
class FlopAwarePolicy(EvictionPolicy):
    track_steps = True

    def __init__(self, alpha: float, cost: CostModel, block_size: int) -> None:
        self.alpha = alpha
        self.cost = cost
        self.block_size = block_size

    @classmethod
    def from_config(cls, config: CacheConfig, cost: CostModel) -> FlopAwarePolicy:
        return cls(config.flop_aware_alpha, cost, config.block_size)

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

    @property
    def can_prune(self) -> bool:
        """Whether `pick_checkpoint_by_recency` applies: scores never fall below their recency term and
        efficiency grows with the step (non-negative alpha and cost coefficients)."""
        cost = self.cost
        return self.alpha >= 0 and cost.flops_per_token >= 0 and cost.attn_flops_per_token_pair >= 0

    def efficiency(self, ckpt: Checkpoint) -> float:
        flops, held = self._checkpoint_value(ckpt)
        return flops / held if held > 0 else 0.0

    def pick_from_order(self, order: RecencyOrder) -> Checkpoint | None:
        """`pick_checkpoint` over the unpinned checkpoints of `order`, pruned by recency when `can_prune`."""
        newest = next((c for c in order.newest_first() if c.num_pins == 0), None)
        if newest is None:
            return None
        if not self.can_prune:
            return self.pick_checkpoint([c for c in order.oldest_first() if c.num_pins == 0])
        top = max(self.efficiency(c) for c in (order.max_step(True), order.max_step(False)) if c is not None)
        unpinned = (c for c in order.oldest_first() if c.num_pins == 0)
        return self.pick_checkpoint_by_recency(unpinned, newest, top)

    def pick_checkpoint_by_recency(
        self, oldest_first: Iterable[Checkpoint], newest: Checkpoint, top_efficiency: float,
    ) -> Checkpoint:
        """The same victim as `pick_checkpoint(candidates)`, found without scoring every candidate.

        `oldest_first` yields the candidates in strictly increasing `last_access`, `newest` is the last of
        them and `top_efficiency` the largest `efficiency` among them (requires `can_prune`). A score is
        its recency term plus a non-negative term, so once the recency term alone exceeds the best score
        found, no later (newer) candidate can win and the scan stops::

            recency term: 0.00  0.10  0.20  0.35 | 0.60 ...   best score so far 0.30 (set by the 2nd)
                          scored ---------------- stop: 0.35 > 0.30, and every later one is larger still
        """
        lo = None
        span: float = 1.0
        top = top_efficiency or 1.0
        best: Checkpoint | None = None
        best_score = 0.0
        for ckpt in oldest_first:
            t = ckpt.last_access
            if lo is None:
                lo = t
                span = (newest.last_access - lo) or 1.0
            recency = (t - lo) / span
            if best is not None and recency > best_score:
                break
            score = recency + self.alpha * self.efficiency(ckpt) / top
            if best is None or score < best_score:
                best, best_score = ckpt, score
        if best is None:
            raise ValueError("pick_checkpoint_by_recency needs at least one candidate")
        return best


def _leaf_recency(node: Node) -> int:
    return max([node.last_access, *(c.last_access for c in node.iter_checkpoints())])


class AdmitAll:
    needs_key = False  # `admit` ignores its key: callers may pass None instead of computing one

    def admit(self, reason: SaveReason, key: Hashable) -> bool:
        return True


class RepeatBranchAdmission:
    """Admit every save except a branch point whose prefix (`key`) has not been seen as one before.

    Remembers the last `capacity` branch-point keys (bounded memory).
    """

    needs_key = True

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


def make_eviction_policy(config: CacheConfig, cost: CostModel) -> EvictionPolicy:
    """The eviction policy `config.eviction` names (`CacheConfig` checked that it is registered)."""
    return EVICTION_POLICIES[config.eviction].from_config(config, cost)


def make_admission_policy(config: CacheConfig) -> AdmissionPolicy:
    """The admission policy `config.admission` names ('learned' is `PrefixCache`'s `LearnedAdmission`,
    asked after this one, which then admits all)."""
    return RepeatBranchAdmission() if config.admission == "repeat_branch" else AdmitAll()
