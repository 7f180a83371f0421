"""What the caller hands the cache (requests, spans) and what the cache hands back (match results)."""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from hybridcache.cache.trie import RootKey


def check_cache_salt(salt: object) -> None:
    """ValueError unless `salt` is None or a non-empty string (vLLM's rule; the message never echoes the salt)."""
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ValueError("cache_salt must be a non-empty string if provided")


class SaveReason(str, Enum):
    """Why a checkpoint was saved; counted in stats (saves and hits by reason)."""

    PREFILL_END = "prefill_end"
    CHUNK_END = "chunk_end"
    FINISH = "finish"
    BRANCH_POINT = "branch_point"
    DECODE_INTERVAL = "decode_interval"
    PREEMPT = "preempt"

    @property
    def is_turn_end(self) -> bool:
        """The end of a turn's prompt or reply (or a preemption): what the next turn of a conversation is restored
        from, and what that turn's first deeper checkpoint shadows (`Checkpoint.shadowed`). Branch points, chunk
        ends and decode intervals serve other prompts."""
        return self in (SaveReason.PREFILL_END, SaveReason.FINISH, SaveReason.PREEMPT)


class MultimodalSpan(NamedTuple):
    """Prompt positions `[start, end)` filled by one multimodal item with content hash `content_hash`."""

    start: int
    end: int
    content_hash: Hashable


@dataclass(frozen=True)
class CacheRequest:
    """One request as the cache sees it.

    request_id     any hashable id, unique among admitted sequences.
    prompt_ids     the prompt's token ids (at least one).
    adapter        LoRA name, None for the base model: each adapter has its own trie root.
    mm_spans       non-overlapping multimodal spans inside the prompt, as `MultimodalSpan` or plain
                   `(start, end, content_hash)` triples; kept sorted by start.
    routed_experts whether the caller wants the routed-expert ids of the prompt: then a partial hit needs the
                   checkpoint's tail routed-expert history, and partial saves need it too.
    skip_reading   the caller must compute every prompt position (it wants the prompt's logits): `match` finds
                   no hit (cached_len 0, nothing pinned); its sequence still saves checkpoints for others.
    cache_salt     vLLM's `cache_salt`: a non-empty string, or None. Part of the trie root with the adapter
                   (`root_key`): requests share blocks and checkpoints only when both are equal, so a salted
                   request never hits what another salt (or no salt) stored, nor leaves anything they can hit.
    memo           values the cache derives from the request alone (its chained block hashes), computed on
                   first use and reused by every match of this object (and by every cache it is given to).
    """

    request_id: Hashable
    prompt_ids: tuple[int, ...]
    adapter: str | None = None
    mm_spans: tuple[MultimodalSpan, ...] = ()
    routed_experts: bool = False
    skip_reading: bool = False
    cache_salt: str | None = field(default=None, repr=False)  # a secret: kept out of reprs (logs, errors)
    _span_ends: tuple[int, ...] = field(init=False, repr=False, compare=False)
    memo: dict = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        prompt = tuple(self.prompt_ids)
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        check_cache_salt(self.cache_salt)
        spans = tuple(sorted(MultimodalSpan(*s) for s in self.mm_spans))
        prev_end = 0
        for span in spans:
            if not 0 <= span.start < span.end <= len(prompt) or span.start < prev_end:
                raise ValueError(f"bad or overlapping multimodal span {span} for a prompt of {len(prompt)}")
            prev_end = span.end
        object.__setattr__(self, "prompt_ids", prompt)
        object.__setattr__(self, "mm_spans", spans)
        object.__setattr__(self, "_span_ends", tuple(s.end for s in spans))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def root_key(self) -> RootKey:
        """The trie root this request's blocks hang from: its adapter and cache salt."""
        return RootKey(self.adapter, self.cache_salt)

    def spans_in(self, start: int, end: int) -> tuple[MultimodalSpan, ...]:
        """The spans overlapping positions `[start, end)` (absolute offsets): the multimodal identity."""
        if not self.mm_spans:
            return ()
        i = bisect.bisect_right(self._span_ends, start)
        out = []
        while i < len(self.mm_spans) and self.mm_spans[i].start < end:
            out.append(self.mm_spans[i])
            i += 1
        return tuple(out)

    def is_safe(self, step: int) -> bool:
        """True when `step` does not fall strictly inside a multimodal span."""
        return not any(s.start < step < s.end for s in self.spans_in(step - 1, step + 1))


class MatchResult(NamedTuple):
    """What `PrefixCache.match` found; immutable. Pass it to `admit` or `release_match` exactly once.

    cached_len       s, the step the request starts from (0 = miss); <= prompt_len - 1, or <= prompt_len with
                     `CacheConfig.full_prompt_hits` (s == prompt_len: a zero-prefill hit, sample only).
    block_ids        the q = s // B shared full blocks (read-only) the request starts with.
    checkpoint_id    the checkpoint restored (pinned until the step after admission is committed), or None.
    checkpoint_reason why that checkpoint was saved, or None.
    divergence_len   how far the prompt agrees with cached content (trie blocks, child blocks, checkpoint
                     tails), clamped to the deepest step a match may return and down to a safe boundary;
                     >= cached_len. When it
                     is larger, ending a chunk there and saving a BRANCH_POINT makes the next such prompt hit.
    divergence_count how many cached continuations leave the prompt at divergence_len (>= 1): the child blocks and
                     checkpoint tails there, on the device and in the host tier, that agree with it up to that step
                     and no further (a tail on the way of another one or of a child block counted with it). The
                     branch point is worth a checkpoint when divergence_len x divergence_count reaches the state's
                     worth (`PrefixCache.saves_branch_point`).
    routed_experts   the checkpoint's tail routed-expert history (opaque), or None.
    """

    match_id: int
    request_id: Hashable
    cached_len: int
    block_ids: tuple[int, ...]
    checkpoint_id: int | None
    checkpoint_reason: SaveReason | None
    divergence_len: int
    divergence_count: int = 1
    routed_experts: Any = None


class Probe(NamedTuple):
    """What `PrefixCache.probe` (a dry-run match) found: `kv_len` tokens of the prompt's full blocks are in the
    trie, and a hit would skip `cached_len` of them (the deepest usable checkpoint's step; 0 = miss).
    `cached_len` can exceed `kv_len` by a partial tail (< B tokens), and is often far below it: KV with no
    state at its end is not a hit for a hybrid model."""

    kv_len: int
    cached_len: int


class Admitted(NamedTuple):
    """A running sequence right after admission: its runtime slot, blocks and computed tokens."""

    request_id: Hashable
    slot: int
    block_ids: tuple[int, ...]
    num_computed: int


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (slice comparisons, O(log n) of them)."""
    if type(a) is not type(b):  # a list slice never equals a tuple slice
        a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
