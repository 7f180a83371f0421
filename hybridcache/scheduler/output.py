"""What one `Scheduler.schedule()` hands the engine: the step's chunks and its copy plan."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.cache.plan import CopyPlan
from hybridcache.multimodal import chunk_embeds, overlaps_image, rope_positions, rope_shift
from hybridcache.scheduler.sequence import Seq


@dataclass(slots=True)
class ScheduledChunk:
    """`seq` feeds `token_ids` = its tokens `[start, start + num_tokens)` in this step.

    `samples`: the chunk reaches the end of the sequence's tokens, so a token is sampled from its logits.
    `block_ids`: the scheduler blocks the forward reads and writes, holding positions `[0, end)` in order,
    as they were BEFORE the step's `commit_step` (which may move the sequence onto a shared copy of a block
    that became full in this step; the forward must still write the sequence's own block). `slot`: the
    sequence's state row. These are the attributes `build_forward_batch` reads.
    `num_drafts`: speculative decoding: the last `num_drafts` of `token_ids` are drafts that follow the
    sequence's last token (a verify row: 1 + num_drafts tokens, the sequence's tokens end at `end - num_drafts`).
    Read-only by contract, not frozen: one is built per sequence per step, and a frozen dataclass's `__init__` (one
    `object.__setattr__` a field) costs ~1 us more (`save_plan.ChunkPlan`'s reason).
    """

    seq: Seq
    start: int
    num_tokens: int
    samples: bool
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    slot: int
    num_drafts: int = 0

    @property
    def end(self) -> int:
        """The step after the chunk's last fed position (its drafts included)."""
        return self.start + self.num_tokens

    @property
    def embeds(self) -> tuple[tuple[int, torch.Tensor], ...]:
        """(offset in the chunk, vectors) of the multimodal spans the chunk overlaps."""
        spans = self.seq.mm_inputs
        return chunk_embeds(spans, self.start, self.end) if spans else ()

    @property
    def rope_positions(self) -> torch.Tensor | None:
        """[3, num_tokens] M-RoPE positions when the chunk overlaps an image span, else None (see `multimodal`)."""
        spans = self.seq.mm_inputs
        return rope_positions(spans, self.start, self.end) if spans and overlaps_image(spans, self.start, self.end) \
            else None

    @property
    def rope_shift(self) -> int:
        """The M-RoPE shift of every token of a chunk that overlaps no image span (the images before it)."""
        return rope_shift(self.seq.mm_inputs, self.start) if self.seq.mm_inputs else 0


@dataclass(frozen=True)
class SampleOnly:
    """`seq` was admitted with its whole prompt cached (a zero-prefill hit): nothing is fed; its next token
    is sampled from the logits of the hidden state its checkpoint kept, which this step's restore copies
    put into `slot` (`ModelRunner.logits_from_slots`)."""

    seq: Seq
    slot: int


@dataclass(frozen=True)
class SchedulerOutput:
    """One step: the chunks to feed (running sequences first, then newly admitted ones), the sequences that
    only sample (`samples`, zero-prefill hits) and the copies the device runs around the forward (restores
    before, saves after). No chunks and no samples: nothing to run."""

    chunks: tuple[ScheduledChunk, ...] = ()
    copies: CopyPlan = CopyPlan()
    samples: tuple[SampleOnly, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.samples
