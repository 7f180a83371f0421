"""Where a chunk ends and which checkpoint it saves: one pure function shared by the engine's scheduler
and the cache simulator (no torch), parameterised by a `CheckpointPolicy`.

Cache modes (the `cache_mode` engine option and the simulator's policies):

| mode            | saves at                                                             | per anchor |
| --------------- | -------------------------------------------------------------------- | ---------- |
| `hybridcache`   | exact prefill end, chunk ends, branch points (and in-flight forks),  | 4          |
|                 | sequence finish; an identical prompt only samples                    |            |
| `seed`          | exact prefill end and chunk ends only, nothing after a partial hit   | 1          |
|                 | (LMDeploy 0.18's seed PR)                                            |            |
| `block-aligned` | chunk ends cut back to block boundaries only (vLLM's align mode)     | 1          |
| `none`          | nothing (prefix caching off)                                         | -          |

Worked example (B = 16, budget 64 tokens, prompt of 100 tokens, a cached checkpoint at step 20 and the
prompt agreeing with cached content up to step 37, so `branch_step` = 37)::

    hybridcache:   [20, 37) branch_point   [37, 100) prefill_end (then one token is sampled)
    seed:          [20, 84)                [84, 100)             (no saves: it started from a partial hit;
                                                                  with hit_len=0, chunk_end and prefill_end)
    block-aligned: [20, 80) chunk_end   [80, 96) chunk_end   [96, 100) no save (100 is not a multiple of B)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridcache.config import CACHE_MODES


@dataclass(frozen=True)
class CheckpointPolicy:
    """Which checkpoints a cache mode saves (see the module docstring), and how it reuses them.

    `full_prompt_hits`: a checkpoint at the prompt's end serves an identical prompt with no prefill at all
    (the slot keeps the last position's hidden state; `CacheConfig.full_prompt_hits`). `share_in_flight`:
    a waiting sequence whose prompt shares a prefix with a prompt still being prefilled waits for that
    prefill to pass the shared part (which it saves as a branch point) and then forks from it.
    `saves_after_hit`: False models LMDeploy 0.18, whose chains stop growing after a partial hit (the blocks
    filled after a checkpoint restored into a partial block are not attached to its trie): a sequence that
    started from a hit at a step that is not a multiple of the block size saves nothing.
    `admission`: the cache's admission policy (`CacheConfig.admission`; 'learned', hybridcache's, admits a
    save reason only while its checkpoints pay for their bytes, `hybridcache.cache.admission`).
    """

    name: str
    chunk_end: bool = True
    finish: bool = True
    branch_point: bool = True
    block_aligned: bool = False
    max_checkpoints_per_anchor: int = 4
    full_prompt_hits: bool = True
    share_in_flight: bool = True
    saves_after_hit: bool = True
    admission: str = "all"


# One policy per name of `config.CACHE_MODES` (the engine config validates modes from that tuple).
POLICIES: dict[str, CheckpointPolicy | None] = {
    "none": None,
    "block-aligned": CheckpointPolicy(
        "block-aligned", finish=False, branch_point=False, block_aligned=True, max_checkpoints_per_anchor=1,
        full_prompt_hits=False, share_in_flight=False,
    ),
    "seed": CheckpointPolicy(
        "seed", finish=False, branch_point=False, max_checkpoints_per_anchor=1, full_prompt_hits=False,
        share_in_flight=False, saves_after_hit=False,
    ),
    "hybridcache": CheckpointPolicy("hybridcache", admission="learned"),
}


def checkpoint_policy(mode: str) -> CheckpointPolicy | None:
    """The policy of a cache mode; None for `none`. Unknown modes are a ValueError listing the known ones."""
    if mode not in POLICIES:
        raise ValueError(f"unknown cache mode {mode!r}; choose one of {', '.join(CACHE_MODES)}")
    return POLICIES[mode]


@dataclass(slots=True)
class ChunkPlan:
    """A chunk `[start, end)` and the save at `end` (`reason` is a `SaveReason` value, or None). Read-only by
    contract, not frozen: one is built per planned sequence per step, and a frozen dataclass's `__init__` (one
    `object.__setattr__` a field) costs several times a plain one's."""

    end: int
    reason: str | None


def plan_chunk(
    policy: CheckpointPolicy | None,
    *,
    start: int,
    num_tokens: int,
    budget: int,
    prompt_len: int,
    block_size: int,
    branch_step: int | None = None,
    decode_interval: int | None = None,
    spans: Sequence[tuple[int, int]] = (),
    hit_len: int = 0,
) -> ChunkPlan:
    """Plan the next chunk of a sequence that has `start` tokens computed and `num_tokens` tokens in all.

    The chunk feeds at most `budget` tokens. A chunk that reaches `num_tokens` samples the next token. The
    prompt is `[0, prompt_len)` (for a re-queued sequence, everything it had when it was queued). The chunk
    is shortened to end exactly at `branch_step` when that lies inside it (and the policy saves branch
    points); with `block_aligned`, a prefill chunk is cut back to the last block boundary inside it.
    Decode steps (one token past the prompt) save only at multiples of `decode_interval`. `hit_len`: the
    tokens the sequence took from the cache when admitted (a policy without `saves_after_hit` saves nothing
    when it is not a multiple of `block_size`: a partial hit).

    A chunk never ends strictly inside a multimodal span `[s, e)` of `spans`: it ends at `s` instead, or,
    when it starts at or inside the span, at `e` (going over the budget: a span is fed whole).
    """
    end = _outside_spans(min(num_tokens, start + budget), start, spans)
    if policy is None or (hit_len % block_size and not policy.saves_after_hit):
        return ChunkPlan(end, None)
    if start >= prompt_len:  # decode
        if decode_interval and end % decode_interval == 0:
            return ChunkPlan(end, "decode_interval")
        return ChunkPlan(end, None)
    if policy.branch_point and branch_step is not None and start < branch_step < end:
        return ChunkPlan(branch_step, "branch_point")
    if policy.block_aligned:
        aligned = end - end % block_size
        if aligned <= start or _outside_spans(aligned, start, spans) != aligned:
            return ChunkPlan(end, None)
        return ChunkPlan(aligned, "prefill_end" if aligned == prompt_len else "chunk_end")
    if end == prompt_len:
        return ChunkPlan(end, "prefill_end")
    return ChunkPlan(end, "chunk_end" if policy.chunk_end else None)


def _outside_spans(end: int, start: int, spans: Sequence[tuple[int, int]]) -> int:
    """Move a chunk end that falls strictly inside a span to the span's start (or end, see `plan_chunk`)."""
    for span_start, span_end in spans:
        if span_start < end < span_end:
            return span_start if span_start > start else span_end
    return end
