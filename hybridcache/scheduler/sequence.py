"""A sequence: one completion of a request, as the scheduler tracks it (and the engine reads it).

It lives below the scheduler so that the scheduler imports nothing from the engine. Named `Seq` so that it
does not shadow `collections.abc.Sequence`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from hybridcache.multimodal import MultimodalInput
from hybridcache.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Seq:
    """Token state of one completion.

    `token_ids` = prompt + generated tokens: the one list of them. While the sequence runs the prefix cache reads
    this very list (it never copies it); `Scheduler.accept` writes a step's tokens into it, the engine appends the
    `PENDING_TOKEN` of a sample still on the device (at most one, always last). `num_computed` = tokens
    whose KV and recurrent state are in the cache (the step the next chunk starts at). The next chunk feeds
    `token_ids[num_computed:...]`; a token is sampled when a chunk reaches the end of `token_ids`. While it
    runs, its blocks and state slot are held by the prefix cache under `seq_id`. `num_cached`: tokens its
    first admission took from the cache. `cache_prompt_len`: the tokens it had when it was last admitted
    (the prompt as the cache sees it; more than `prompt_len` after a preemption). `branch_step`: where its
    prompt diverges from cached content (a chunk ends there, to save a branch-point checkpoint), or None.
    `fork_steps`: steps of its prompt where waiting sequences that share the prefix [0, step) with it will
    fork from it (in-flight sharing): a chunk ends at each, saving a branch point. `hint_steps`: prompt steps
    the caller expects later prompts to part from this one (`LLMEngine.add_request`'s `checkpoints_at`, e.g. a
    chat's end before its generation prompt): a chunk ends at each that the cache would save as a branch point.
    `mm_inputs`: its multimodal spans (with embeddings), sorted by start. `cache_salt`: its request's cache salt
    (`LLMEngine.add_request`), part of its prefix cache root: it shares cached content only with equal salts.
    `drafts`: speculative decoding: tokens proposed to follow `token_ids` (the engine's drafter sets them); its
    next decode step feeds them after its last token and keeps the prefix the verification accepts
    (`Scheduler.accept`). Empty otherwise. `num_draft_tokens` / `num_accepted_tokens`: how many drafts
    its steps fed, and accepted.
    """

    seq_id: int
    request_id: str
    index: int
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None
    arrival: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    num_cached: int | None = None
    cache_prompt_len: int = 0
    branch_step: int | None = None
    fork_steps: set[int] = field(default_factory=set)
    hint_steps: tuple[int, ...] = ()
    finish_reason: str | None = None
    mm_inputs: tuple[MultimodalInput, ...] = ()
    cache_salt: str | None = field(default=None, repr=False)  # a secret: kept out of reprs
    drafts: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
