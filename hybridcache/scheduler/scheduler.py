"""Continuous batching over the prefix cache: which sequences feed how many tokens in the next forward.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go first, oldest first (a decode
costs one token, an unfinished prefill takes what the budget leaves); then waiting sequences are admitted
in arrival order while the budget, `max_num_seqs` and memory allow. Where a chunk ends and which checkpoint
it saves come from `save_plan.plan_chunk` (branch points, chunk ends, block alignment per cache mode).

Admission is two-phase through `PrefixCache`: `match` (pins the checkpoint it would restore), then
`admit(match, first_chunk_end)` (slot + blocks for the cached prefix and the first chunk, restore copies
queued) or, when there is no room, `release_match`, which leaves the cache exactly as it was.

A match may cover the whole prompt (a zero-prefill hit, when the mode keeps the last hidden state): the
sequence then feeds nothing in its first step and only samples (`SchedulerOutput.samples`). A waiting
sequence that shares a prefix with a prompt still being prefilled waits for it and forks from its checkpoint
instead of computing the prefix again (`in_flight.py`): `n` completions of a prompt prefill it once.

One owner of a sequence's tokens: `Seq.token_ids`. The cache is given that very list at admission and reads it
(never copies it); once a step's tokens are known, `accept` takes them in one call: it writes them into the list
(the sampled token in place of the sequence's `PENDING_TOKEN`, or after its end; a verify row's kept drafts
before it) and tells the cache (`PrefixCache.accept`: the value of a token it was fed as `PENDING_TOKEN`, the
kept drafts; full blocks join the trie, `STATE_ROLLBACK` copies come back).

Speculative decoding (`num_speculative_tokens` k > 0): a decoding sequence with `drafts` feeds them after its
last token (a verify row of 1 + n tokens, n <= k) and the cache takes them as drafts; after the forward,
`accept` keeps each row's accepted prefix of them. A chunk that samples gets blocks for 3k positions past its
end: k drafts fed next, the drafter's own KV for the drafts it proposes (written ahead of the verify), and k more
for an async verify step queued before this one is judged (`engine/spec_chain.py`).

When a running sequence cannot grow, the newest running sequence is preempted: the cache keeps its computed
prefix as a checkpoint (when the mode saves any), frees the rest, and the sequence goes back to the front of
the waiting queue; on re-admission its prefix is a hit.

The scheduler is the only component that calls the cache. `schedule()` ends the step's cache work in this
order, here and nowhere else::

    plan chunks (ensure_capacity / match + admit / reserve_save)  ->  read each chunk's block ids and slot
    ->  commit_step(fed tokens)  ->  SchedulerOutput(chunks, copies)

Block ids are read before `commit_step` because the forward writes the blocks the step was planned with;
`commit_step` may swap a sequence onto a shared copy of a block that became full in this step.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

from hybridcache.cache import PENDING_TOKEN, CacheRequest, CacheStats, CopyPlan, MatchResult, PrefixCache
from hybridcache.scheduler.in_flight import find_leader, prompt_share, worth_sharing
from hybridcache.scheduler.output import SampleOnly, ScheduledChunk, SchedulerOutput
from hybridcache.scheduler.save_plan import CheckpointPolicy, ChunkPlan, plan_chunk
from hybridcache.scheduler.sequence import Seq, SeqStatus

# A prompt chunk of a request with prompt logprobs gets logits [rows, vocab] in fp32 for every row, which the memory
# plan does not hold: 1,024 rows of a 248k vocabulary are 1 GB. A step's prompt chunks of such requests hold at most
# this many tokens together.
PROMPT_LOGPROBS_CHUNK = 1024


def blocks_per_sequence(max_model_len: int, block_size: int, num_speculative_tokens: int) -> int:
    """The blocks one sequence may hold at once: `max_model_len` positions and, with speculative decoding, the 3k
    past its end that a chunk which samples asks for (`Scheduler._lookahead`). A pool with fewer cannot finish a
    sequence that reaches `max_model_len`."""
    return -(-(max_model_len + 3 * num_speculative_tokens) // block_size)


@dataclass(slots=True)
class Accepted:
    """What a step made known for one sequence (`Scheduler.accept`): `kept`, for a verify row (one that fed
    drafts), the prefix of its drafts it keeps (None: the row fed no drafts); `sampled`, the token sampled after
    them (None: a stop cut the step's tokens before it). Read-only by contract, not frozen (one per sampled
    sequence per step: `ChunkPlan`'s reason)."""

    sampled: int | None = None
    kept: tuple[int, ...] | None = None


class _Admission(enum.Enum):
    ADMITTED = "admitted"
    NO_ROOM = "no_room"
    WAITS_FOR_LEADER = "waits_for_leader"  # shares a prefix with a prompt being prefilled (in_flight.py)


class Scheduler:
    """Waiting and running queues over a `PrefixCache`; see the module docstring for the policy.

    `debug`: check the cache's integrity whenever the last running sequence leaves (slow; for tests)."""

    def __init__(
        self,
        cache: PrefixCache,
        policy: CheckpointPolicy | None,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        decode_checkpoint_interval: int | None = None,
        num_speculative_tokens: int = 0,
        debug: bool = False,
    ) -> None:
        self.cache = cache
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_checkpoint_interval = decode_checkpoint_interval
        self.num_speculative_tokens = num_speculative_tokens
        self.debug = debug
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.num_preemptions = 0
        self._prompt_rows = PROMPT_LOGPROBS_CHUNK  # the rows of prompt logits the step being planned may still take

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Plan the next forward and commit it to the cache (see the module docstring for the order).

        Returns an empty output when there is nothing to run; raises RuntimeError when there is work but no
        sequence fits (the KV pool or the slot count is too small for even one)."""
        planned, samples = self._plan_step()
        if not planned and not samples:
            if self.has_work:
                raise RuntimeError("no sequence could be scheduled: the KV pool or slot count is too small")
            return SchedulerOutput()
        chunks = tuple(self._chunk(seq, end) for seq, end in planned)  # block ids: before commit_step
        drafts = {chunk.seq.seq_id: chunk.num_drafts for chunk in chunks if chunk.num_drafts}
        copies = self.cache.commit_step({chunk.seq.seq_id: chunk.token_ids for chunk in chunks}, drafts)
        return SchedulerOutput(chunks, copies, tuple(SampleOnly(seq, self.cache.slot(seq.seq_id)) for seq in samples))

    def _plan_step(self) -> tuple[list[tuple[Seq, int]], list[Seq]]:
        """(sequence, chunk end) of each sequence that feeds tokens in the next forward, in batch order, and
        the newly admitted sequences whose whole prompt was a hit (they only sample).

        Running sequences whose prompt is computed (decode and verify rows) are planned first, oldest first, then
        those still prefilling take what the budget leaves, as vLLM puts decodes first: a younger sequence that
        began decoding while an older prompt's chunk ended short of the budget (at a branch point or a fork step)
        would otherwise get no token until that prompt's whole prefill was done."""
        budget = self.max_num_batched_tokens
        self._prompt_rows = PROMPT_LOGPROBS_CHUNK
        planned: list[tuple[Seq, int]] = []
        samples: list[Seq] = []
        followers: list[Seq] = []
        preempted = False
        costs: dict[int, int] = {}  # seq_id -> what its planned chunk took of the budget
        for seq in sorted(self.running, key=lambda s: s.num_computed < s.cache_prompt_len):  # (a stable sort)
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            if self._prompt_rows == 0 and self._wants_prompt_rows(seq, seq.num_computed):
                continue  # the step's prompt logits are taken: its next chunk waits a step
            plan = self._plan(seq, seq.num_computed, budget)
            while not self.cache.ensure_capacity(seq.seq_id, plan.end + self._lookahead(seq, plan)):
                victim = self.running[-1]  # the newest, even if planned above (a decode ahead of this prefill)
                self._preempt(victim)  # (releases what it holds, what it was planned with too)
                preempted = True
                if victim is seq:
                    break
                if victim.seq_id in costs:  # unplanned, its budget back (as vLLM's scheduler does)
                    planned = [entry for entry in planned if entry[0] is not victim]
                    budget += costs.pop(victim.seq_id)
            if seq.status is SeqStatus.RUNNING:
                self._take_prompt_rows(seq, seq.num_computed, plan)
                planned.append(self._reserve(seq, plan))
                cost = plan.end - seq.num_computed + len(seq.drafts)  # (_reserve cleared drafts it cannot feed)
                costs[seq.seq_id] = min(cost, budget)
                budget = max(0, budget - cost)  # a multimodal span or drafts may go over it
        try:
            while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                if self._prompt_rows == 0 and self._wants_prompt_rows(seq, 0):
                    break  # (admitted in order: it waits for a step with room for its prompt logits)
                admission = self._admit(seq, budget)
                if admission is _Admission.NO_ROOM:
                    break
                self.waiting.popleft()
                if admission is _Admission.WAITS_FOR_LEADER:
                    followers.append(seq)
                    continue
                self.running.append(seq)
                if seq.num_computed == seq.num_tokens:  # the whole prompt was a hit: sample only
                    samples.append(seq)
                    continue
                self._note_forks(seq)
                plan = self._plan(seq, seq.num_computed, budget)
                self._take_prompt_rows(seq, seq.num_computed, plan)
                planned.append(self._reserve(seq, plan))
                budget = max(0, budget - (plan.end - seq.num_computed))
        finally:  # (also when an admission raises: they must not be lost)
            self.waiting.extendleft(reversed(followers))  # back to the front, in arrival order
        return planned, samples

    def _admit(self, seq: Seq, budget: int) -> _Admission:
        """Match and admit a waiting sequence with room for its first chunk. NO_ROOM and WAITS_FOR_LEADER
        change nothing in the cache (the leader is told where to save for it)."""
        spans = tuple((m.start, m.end, m.content_hash) for m in seq.mm_inputs)
        whole = seq.params.prompt_logprobs is not None  # its prompt's logits are wanted: compute every position
        request = CacheRequest(seq.seq_id, tuple(seq.token_ids), mm_spans=spans, skip_reading=whole,
                               cache_salt=seq.cache_salt)
        match = self.cache.match(request)
        if self.policy is not None and self.policy.share_in_flight and not whole:
            found = find_leader(seq, self.running, match.cached_len, self.cache.block_size)
            if found is not None:
                leader, shared = found
                self.cache.release_match(match)
                if shared < leader.cache_prompt_len:
                    leader.fork_steps.add(shared)
                return _Admission.WAITS_FOR_LEADER
        seq.cache_prompt_len = seq.num_tokens
        if not self._admit_match(seq, match, budget):
            # A hit holds its pinned path and frozen tail next to its private tail block: in a pool just big
            # enough for the prompt, only a miss fits. Nothing running can free more: run it as a miss.
            if match.cached_len == 0 or self.running:
                return _Admission.NO_ROOM
            match = self.cache.match(request, max_step=0)
            if not self._admit_match(seq, match, budget):
                return _Admission.NO_ROOM
        seq.num_computed = match.cached_len
        if seq.num_cached is None:
            seq.num_cached = match.cached_len
        seq.status = SeqStatus.RUNNING
        return _Admission.ADMITTED

    def _admit_match(self, seq: Seq, match: MatchResult, budget: int) -> bool:
        """Admit `seq` from `match` with room for its first chunk; False (match released) when there is none."""
        branch = match.divergence_len
        worth = self.cache.saves_branch_point(branch, match.divergence_count)
        seq.branch_step = branch if branch > match.cached_len and worth else None
        plan = self._plan(seq, match.cached_len, budget)
        if self.cache.admit(match, plan.end + self._lookahead(seq, plan), seq.token_ids) is None:
            self.cache.release_match(match)
            return False
        return True

    def _note_forks(self, leader: Seq) -> None:
        """Before a newly admitted sequence plans its first chunk: the waiting sequences right behind it that
        will follow it (`in_flight.py`) get their fork step on it now, so that its first chunk ends there."""
        if self.policy is None or not self.policy.share_in_flight:
            return
        for other in islice(self.waiting, 0, self.max_num_seqs):
            shared = prompt_share(leader, other)
            if leader.num_computed < shared < leader.cache_prompt_len and worth_sharing(
                shared, leader.num_computed, other.num_tokens, self.cache.block_size
            ):
                leader.fork_steps.add(shared)

    @staticmethod
    def _wants_prompt_rows(seq: Seq, start: int) -> bool:
        """Whether a chunk of `seq` from `start` computes rows of prompt logits (its request asks for prompt
        logprobs, and its prompt is not all computed)."""
        return seq.params.prompt_logprobs is not None and start < seq.prompt_len

    def _take_prompt_rows(self, seq: Seq, start: int, plan: ChunkPlan) -> None:
        """Count a planned chunk's rows of prompt logits against the step's `PROMPT_LOGPROBS_CHUNK` (a chunk of a
        sequence preempted later in the step keeps its count: the step then plans fewer, never more). A multimodal
        span is fed whole, so a chunk may take more rows than were left: the count stops at 0 (none left), never
        below, where a later chunk would be planned to end before it starts."""
        if self._wants_prompt_rows(seq, start):
            self._prompt_rows = max(0, self._prompt_rows - (min(plan.end, seq.prompt_len) - start))

    def _plan(self, seq: Seq, start: int, budget: int) -> ChunkPlan:
        if self._wants_prompt_rows(seq, start):
            budget = min(budget, self._prompt_rows)
        stop = None
        if start < seq.cache_prompt_len:  # a prompt chunk (a decode chunk ends at no branch step)
            hints = (s for s in seq.hint_steps if self.cache.saves_branch_point(s))
            stop = min((s for s in (seq.branch_step, *seq.fork_steps, *hints) if s is not None and s > start),
                       default=None)
        return plan_chunk(
            self.policy,
            start=start,
            num_tokens=seq.num_tokens,
            budget=budget,
            prompt_len=seq.cache_prompt_len,
            block_size=self.cache.block_size,
            branch_step=stop,
            decode_interval=self.decode_checkpoint_interval,
            spans=[(m.start, m.end) for m in seq.mm_inputs] if seq.mm_inputs else (),
            hit_len=start if seq.num_cached is None else seq.num_cached,
        )

    def _lookahead(self, seq: Seq, plan: ChunkPlan) -> int:
        """Positions past a chunk's end it needs blocks for: 3k when it samples with speculative decoding on
        (its drafts, the drafter's KV of the drafts it proposes after it, and k more: an async verify step is
        queued before the step before it is judged, at up to k positions further, `engine/spec_chain.py`),
        else 0."""
        return 3 * self.num_speculative_tokens if plan.end == seq.num_tokens else 0

    def growth_fits(self, chunks: Sequence[ScheduledChunk], most: int) -> bool:
        """Whether the free blocks hold the growth of the next plan of the decode chunks' sequences when each
        advances by at most `most` tokens, so that planning it preempts none (async speculative steps)."""
        size, k = self.cache.block_size, self.num_speculative_tokens
        need = sum(max(0, -(-(c.start + most + 1 + 3 * k) // size) - len(c.block_ids)) for c in chunks)
        return need <= self.cache.num_free_blocks

    def _drafts(self, seq: Seq, plan: ChunkPlan) -> list[int]:
        """The drafts a chunk feeds: the sequence's, when the chunk is its decode row (its last token, at or past
        the prompt the cache knows) and saves nothing."""
        if seq.drafts and plan.reason is None and plan.end == seq.num_tokens and seq.num_computed == plan.end - 1 \
                and seq.num_computed >= seq.cache_prompt_len:
            return seq.drafts
        return []

    def _reserve(self, seq: Seq, plan: ChunkPlan) -> tuple[Seq, int]:
        if plan.reason is not None:
            self.cache.reserve_save(seq.seq_id, plan.end, plan.reason)
        if not self._drafts(seq, plan):
            seq.drafts = []  # a chunk that cannot verify them: they are stale after it
        return seq, plan.end

    def _chunk(self, seq: Seq, end: int) -> ScheduledChunk:
        start = seq.num_computed
        drafts = seq.drafts if end == seq.num_tokens else []
        return ScheduledChunk(
            seq=seq,
            start=start,
            num_tokens=end - start + len(drafts),
            samples=end == seq.num_tokens,
            token_ids=(*seq.token_ids[start:end], *drafts),
            block_ids=self.cache.block_ids(seq.seq_id),
            slot=self.cache.slot(seq.seq_id),
            num_drafts=len(drafts),
        )

    def finish(self, seq: Seq) -> None:
        """Remove a finished or aborted sequence. A running one that finished normally leaves a finish
        checkpoint when the mode saves them; an aborted one (`seq.finish_reason == 'abort'`) leaves nothing."""
        if seq in self.running:
            self.running.remove(seq)
            if self.policy is not None and self.policy.finish and seq.finish_reason != "abort":
                self.cache.finish(seq.seq_id)
            else:
                self.cache.abort(seq.seq_id)
            if self.debug and not self.running:
                self.check_integrity()
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def accept(self, accepted: Mapping[Seq, Accepted]) -> CopyPlan:
        """Once per step, when its tokens are known (after the forward; with async scheduling after the next step
        was committed): each sequence's `Accepted` goes into its `token_ids`, the one list of its tokens: the kept
        drafts after its last token (they are computed: `num_computed` advances), then the sampled token, in
        place of its `PENDING_TOKEN` (at most one, always last: async scheduling fed it before it was known) or
        after its end. A verify row's drafts are then judged (`drafts` cleared). The cache reads the same list
        and takes, in the same call, what it fed unknown (`PrefixCache.accept`: a verify row's kept drafts, the
        value of a `PENDING_TOKEN`); sequences no longer running are written only. Returns the cache's
        `STATE_ROLLBACK` copies, which the caller runs before the next step. A ValueError from the cache (tokens
        it cannot take) comes after the lists were written: the engine treats it as fatal."""
        stuck = [seq.seq_id for seq, step in accepted.items() if step.kept is not None and seq.token_ids[-1:] == [
            PENDING_TOKEN]]
        if stuck:
            raise ValueError(f"sequences {stuck} keep drafts after a pending token")
        taken: dict[int, tuple[int, ...]] = {}
        for seq, step in accepted.items():
            tokens = seq.token_ids
            if step.kept is not None:
                seq.drafts = []
                tokens.extend(step.kept)
            if step.sampled is not None:
                if tokens and tokens[-1] == PENDING_TOKEN:
                    tokens[-1] = step.sampled
                else:
                    tokens.append(step.sampled)
            if seq.status is SeqStatus.RUNNING:
                if step.kept is not None:
                    seq.num_computed += len(step.kept)
                    taken[seq.seq_id] = step.kept
                elif step.sampled is not None:
                    taken[seq.seq_id] = (step.sampled,)
        return self.cache.accept(taken)

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.cache.preempt(seq.seq_id, keep_checkpoint=self.policy is not None and self.policy.finish)
        seq.num_computed = 0
        seq.drafts = []
        seq.fork_steps.clear()
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    # ------------------------------------------------------------------------ what the engine may ask
    def check_integrity(self) -> None:
        """Recompute the cache's counts from scratch and check that it runs exactly the running sequences;
        raises on any mismatch."""
        self.cache.check_integrity()
        running = sorted(seq.seq_id for seq in self.running)
        if sorted(self.cache.running_ids()) != running:
            raise AssertionError(f"cache runs {sorted(self.cache.running_ids())}, scheduler runs {running}")

    def clear_cache(self) -> None:
        """Drop everything the prefix cache holds for no running sequence (see `PrefixCache.clear`)."""
        self.cache.clear()

    def flush_retired_copies(self) -> CopyPlan:
        """With no sequence left: commit an empty step, whose plan carries the state copies of the sequences
        retired since the last step (the STATE_FINISH of their finish checkpoints rides on the next step's plan),
        for the caller to run. For shutdown: those checkpoints are written, so they can be kept behind."""
        if self.has_work:
            raise RuntimeError("flush_retired_copies needs every sequence finished or aborted")
        return self.cache.commit_step({})

    def keep_cache_behind(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Hand the cache's checkpoints to the tier behind the host one (see `PrefixCache.keep_behind`)."""
        return self.cache.keep_behind(progress)

    def stats(self) -> dict:
        """The cache's stats plus block, slot and queue counts."""
        cache: CacheStats = self.cache.stats
        return {
            "cache": cache,
            "num_blocks_used": cache.num_blocks_used,
            "num_slots": self.cache.config.num_slots,
            "num_slots_used": cache.num_slots_used,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_preemptions": self.num_preemptions,
        }
