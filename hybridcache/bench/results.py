"""What a replay counts while it runs (`Counters`, mutable) and the report it ends with (`PolicyResult`, built by
`policy_result`); every replay of replay.py and oracles.py keeps one `Counters`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hybridcache.bench.workloads import SimRequest
from hybridcache.engine.cost_model import ModelCost


@dataclass
class Counters:
    """What one policy did over a workload (mutable while it runs)."""

    num_requests: int = 0
    num_sequences: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    flops_saved: float = 0.0
    num_uncacheable: int = 0
    bytes_peak: int = 0
    host_save_blocks: int = 0
    host_load_blocks: int = 0
    host_hit_tokens: int = 0
    hits_by_reason: dict[str, int] = field(default_factory=dict)
    hit_tokens_by_turn: dict[int, list[int]] = field(default_factory=dict)

    def add(self, request: SimRequest, hit_tokens: int, cost: ModelCost, reason: str | None = None,
            host_hit_tokens: int = 0) -> None:
        """One completed sequence of `request` that skipped `hit_tokens` prompt tokens, restored from a
        checkpoint saved for `reason` (None: a miss), `host_hit_tokens` of them from the host tier (0 or
        `hit_tokens`). A sequence admitted with a hit and then run without the cache is added as a miss, so that
        the hit tokens, the hits by reason and the host hit tokens count the same sequences."""
        self.num_sequences += 1
        self.prompt_tokens += request.prompt_len
        self.hit_tokens += hit_tokens
        self.host_hit_tokens += host_hit_tokens
        if reason is not None:
            self.hits_by_reason[reason] = self.hits_by_reason.get(reason, 0) + 1
        self.flops_saved += cost.prefill_flops(hit_tokens)
        by_turn = self.hit_tokens_by_turn.setdefault(request.turn, [0, 0])
        by_turn[0] += hit_tokens
        by_turn[1] += request.prompt_len


@dataclass(frozen=True)
class PolicyResult:
    """The simulator's report for one policy. `token_hit_rate` = hit tokens / prompt tokens (every
    completion counts its prompt); `bytes_peak` = the largest KV + checkpoint-state bytes held (for
    `oracle`: the KV of every distinct fed token; its states are not counted). `hits_by_reason`: the completions
    whose hit `hit_tokens` counts, by the reason of the checkpoint restored (one admitted with a hit and then run
    without the cache for want of room counts as a miss everywhere). Host tier: `host_blocks` (None: none), the
    hit tokens served from it (within `hit_tokens`), the bytes copied each way (demotions: device -> host,
    promotions: host -> device) and the promotions skipped as not worth their copy."""

    name: str
    token_hit_rate: float
    prefill_tokens_computed: int
    flops_saved: float
    checkpoints_saved: int
    evictions: int
    bytes_peak: int
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    num_uncacheable: int
    num_blocks: int | None
    num_slots: int | None
    state_pages: int | None  # paged: blocks per checkpoint state (None: two pools, or no cache)
    hits_by_reason: dict[str, int]
    evictions_by_kind: dict[str, int]
    hit_rate_by_turn: dict[int, float]
    host_blocks: int | None = None
    host_hit_tokens: int = 0
    host_save_bytes: int = 0
    host_load_bytes: int = 0
    promotions_skipped: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def policy_result(name: str, c: Counters, **extra) -> PolicyResult:
    """`name`'s result from its counters; `extra` sets the fields that counters do not hold (a cache's: its
    saves, evictions and sizes), which default to none."""
    values = dict(checkpoints_saved=0, evictions=0, num_blocks=None, num_slots=None, state_pages=None,
                  hits_by_reason={}, evictions_by_kind={})
    values.update(extra)
    return PolicyResult(
        name=name,
        token_hit_rate=c.hit_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        prefill_tokens_computed=c.prompt_tokens - c.hit_tokens,
        flops_saved=c.flops_saved,
        bytes_peak=c.bytes_peak,
        num_requests=c.num_requests,
        prompt_tokens=c.prompt_tokens,
        hit_tokens=c.hit_tokens,
        num_uncacheable=c.num_uncacheable,
        hit_rate_by_turn={t: h / p if p else 0.0 for t, (h, p) in sorted(c.hit_tokens_by_turn.items())},
        **values,
    )
