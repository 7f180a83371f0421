"""Configuration of the prefix cache and the cost model the FLOP-aware policies read."""

from __future__ import annotations

import math
from dataclasses import dataclass

ADMISSION_POLICIES = ("all", "repeat_branch", "learned")


@dataclass(frozen=True)
class CacheConfig:
    """Sizes and policies of one `PrefixCache`.

    block_size                 B, tokens per KV block (the unit of sharing and of trie identity).
    num_blocks                 logical KV block ids `0 .. num_blocks - 1` the cache hands out.
    num_slots                  state slots `0 .. num_slots - 1`. Two pools (`state_pages` None): shared by
                               running sequences (one each) and checkpoints (one each); checkpoints borrow idle
                               slots and are evicted when a running sequence needs one; size it as
                               `max_running + checkpoint slots`. Paged: runtime slots only (`max_running`).
    state_pages                None: checkpoint states live in state slots (two pools: KV blocks, slots).
                               k >= 1: **paged**: a checkpoint's state lives in k blocks of the KV pool, its
                               pages (k = ceil(state bytes / block bytes)); blocks are the one budget, KV and
                               states compete in one eviction order (`Evictor.byte_victim`), and a finished or
                               preempted sequence's state is copied into pages by the next plan (STATE_FINISH;
                               plan.py). What the engine runs.
    max_checkpoints_per_anchor how many checkpoints (different steps or tails) may hang on one trie node.
    decode_checkpoint_interval tokens between decode checkpoints (a multiple of B), None = off. The cache only
                               validates it; the scheduler reserves the saves (see docs/cache.md).
    eviction                   'lru' or 'flop_aware' (recency + alpha * FLOPs saved per byte held).
    flop_aware_alpha           the alpha of 'flop_aware'.
    admission                  'all' (admit every save) or 'repeat_branch' (a branch point is saved only
                               the second time the same prefix is seen as a branch point) or 'learned'
                               (when a save would evict something, a save reason is admitted per adapter
                               only while its checkpoints save enough prefill tokens for their bytes;
                               admission.py; the engine's `hybridcache` mode uses it).
    min_branch_point_step      a prompt's divergence from cached content at step d, left there by n cached
                               continuations (`MatchResult.divergence_count`), is a branch point worth a
                               checkpoint only when d x n >= this (0: always; `PrefixCache.saves_branch_point`,
                               which the scheduler asks). The engine sets it to `CostModel.state_tokens` of its
                               real cost model: the prefill a branch point would have saved the prompts already
                               seen leaving there must add up to the state its checkpoint occupies (two prompts
                               sharing their first letters must not cost a state each; a system prompt shared by
                               enough conversations is worth one).
    full_prompt_hits           checkpoints hold the last position's final hidden state (the device keeps it
                               in the slot), so `match` may return step == prompt_len: a zero-prefill hit,
                               where the engine computes only the sample (ARCHITECTURE 4.4). Off: step <=
                               prompt_len - 1 (a checkpoint at N is reused only by longer prompts).
    host_blocks                blocks of host memory (each the size of a device block) behind the device pool,
                               0 = no host tier. Device eviction demotes trie leaves and checkpoints there and a
                               hit promotes them back (host_tier.py; docs/cache.md, "The host tier"). Paged only.
    num_speculative_tokens     k: the most draft tokens a sequence may feed after its last token in one step
                               (speculative decoding; 0 = off). Names the draft states of `STATE_ROLLBACK`
                               (`slot * k + j`, plan.py).
    keeps_blocks               False: prefix caching is off; a sequence's full blocks stay private (no trie
                               node, no event) and are freed when it ends, so nothing is kept, matched or
                               reported.
    """

    block_size: int = 64
    num_blocks: int = 1024
    num_slots: int = 64
    max_checkpoints_per_anchor: int = 4
    decode_checkpoint_interval: int | None = None
    eviction: str = "lru"
    flop_aware_alpha: float = 1.0
    admission: str = "all"
    full_prompt_hits: bool = False
    state_pages: int | None = None
    min_branch_point_step: int = 0
    host_blocks: int = 0
    num_speculative_tokens: int = 0
    keeps_blocks: bool = True

    @property
    def paged(self) -> bool:
        """Checkpoint states live in KV blocks (`state_pages`)."""
        return self.state_pages is not None

    @property
    def checkpoint_capacity(self) -> int:
        """About how many checkpoints the pools hold: the slots, or (paged) the blocks over k."""
        return max(1, self.num_blocks // self.state_pages) if self.state_pages else self.num_slots

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks < 1 or self.num_slots < 1:
            raise ValueError("num_blocks and num_slots must be >= 1")
        if self.max_checkpoints_per_anchor < 1:
            raise ValueError("max_checkpoints_per_anchor must be >= 1")
        interval = self.decode_checkpoint_interval
        if interval is not None and (interval < 1 or interval % self.block_size):
            raise ValueError(f"decode_checkpoint_interval {interval} is not a multiple of block_size")
        from hybridcache.cache.policy import EVICTION_POLICIES  # the registry (policy.py imports this module)

        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {tuple(EVICTION_POLICIES)}, got {self.eviction!r}")
        if self.state_pages is not None and self.state_pages < 1:
            raise ValueError(f"state_pages must be >= 1 or None, got {self.state_pages}")
        if self.min_branch_point_step < 0:
            raise ValueError(f"min_branch_point_step must be >= 0, got {self.min_branch_point_step}")
        if self.host_blocks < 0 or (self.host_blocks and self.state_pages is None):
            raise ValueError(f"host_blocks must be >= 0 and needs paged states (state_pages), got {self.host_blocks}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.admission not in ADMISSION_POLICIES:
            raise ValueError(f"admission must be one of {ADMISSION_POLICIES}, got {self.admission!r}")


@dataclass(frozen=True)
class CostModel:
    """What a token costs to compute and to hold (the FLOP-aware policy), and to copy from the host tier.

    prefill_flops(n) = flops_per_token * n + attn_flops_per_token_pair * n * (n + 1) / 2
    A checkpoint holds `state_bytes` (one slot) plus, when partial, one frozen block of
    `block_size * kv_bytes_per_token`; a trie node holds one block.
    host_bandwidth   bytes per second of a host -> device copy (inf: copies are free).
    device_flops     FLOPs per second the device computes a prefill at.
    A promotion from the host tier pays when its copy takes no longer than recomputing what it saves
    (`promotion_pays`).
    """

    flops_per_token: float = 1.0
    attn_flops_per_token_pair: float = 0.0
    kv_bytes_per_token: float = 1.0
    state_bytes: float = 64.0
    host_bandwidth: float = float("inf")
    device_flops: float = 1e15

    def promotion_pays(self, copy_bytes: float, start: int, end: int) -> bool:
        """Whether copying `copy_bytes` from the host is no slower than computing tokens [start, end)."""
        recompute = (self.prefill_flops(end) - self.prefill_flops(start)) / self.device_flops
        return copy_bytes / self.host_bandwidth <= recompute

    @property
    def state_tokens(self) -> int:
        """The tokens whose KV takes as many bytes as one checkpoint's state (`state_bytes`), rounded up: a
        prefix shorter than this is worth less than the state a checkpoint of it occupies."""
        return math.ceil(self.state_bytes / self.kv_bytes_per_token) if self.kv_bytes_per_token > 0 else 0

    def prefill_flops(self, num_tokens: int) -> float:
        return self.flops_per_token * num_tokens + self.attn_flops_per_token_pair * num_tokens * (
            num_tokens + 1
        ) / 2
