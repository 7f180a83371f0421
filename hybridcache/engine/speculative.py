"""MTP speculative decoding in the engine: judging verify rows, and proposing drafts with the MTP head.

A decode step of a sequence with drafts feeds its last token t and its n drafts d1..dn (a *verify row*, positions
s..s+n; the scheduler and the cache take them as drafts). The target's logits at position s + j judge draft
d_{j+1}; the first rejected draft ends the row, and the token sampled there (or after dn when all pass) is the
row's last output token::

    fed        t    d1   d2   d3          (n = 3, positions s .. s+3)
    target     a0   a1   a2   a3          greedy: a_j = argmax of the target at position s + j
    d1 == a0, d2 == a1, d3 != a2   ->   accepted [d1, d2], final token a2: the step emits d1 d2 a2

Greedy rows accept while the draft equals the target's argmax. Random rows use rejection sampling (Leviathan et
al. 2023; Chen et al. 2023) with the draft distribution a point mass (the head drafts greedily): draft d is
accepted with probability p(d) under the target's processed distribution p at that position (temperature,
top-k/p, min-p, logit bias, min_tokens), and a rejection samples from p with d removed, renormalised; after n
accepted drafts the last token is drawn from p at the last position. For a point mass that rule is one draw:
x ~ p at the position, the draft kept iff x == d, else x is the row's last token (P(keep) = p(d); given x != d, x
is distributed as p without d, renormalised). Each position draws x as the sampler without drafts does
(`sampling.sample_async`'s exponential race, one Exp(1) per vocabulary entry from the sequence's generator), so
every emitted token costs its generator one draw whatever was drafted: a seeded request draws the same tokens
with MTP on or off, after a zero-prefill hit, a preemption or a different batch (up to the logits' float noise).

Position j of a row is processed as a row without drafts whose tokens end with d1..dj: penalties and min_tokens
count those drafts (`_PositionRow`), and a structured-output row is masked with its grammar's state after them
(`judge`'s `grammar_masks`, `OutputProcessor.draft_bitmask`) before anything else, as `sampling.sample_async`
masks it; a draft the grammar refuses can never be taken, so the positions after it are not reached.

After the step (`MtpDrafter.propose`), the head runs once over every position the step computed (its KV there:
row p reads the token at p + 1 and the target's final hidden state at p) and then drafts greedily, one position
per step, feeding its own output hidden state back (the plan is built here, on the host, and run by the executor:
`engine/mtp_draft.py`, on every rank under tensor parallelism). The drafts go to `Seq.drafts` for the next step.
A uniform plan replays a drafting graph (`engine/draft_graphs.py`); after a verify step whose rows are all plain
greedy, the engine queues that drafting on the device before judging (`greedy_verify`, `near_pages`, the runner's
`draft_after_verify`), and `propose` only takes its drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hybridcache.engine.input_builder import PageRows, SeqChunk, build_forward_batch
from hybridcache.engine.mtp_draft import DraftPlan, DraftStep
from hybridcache.forward_batch import ForwardBatch
from hybridcache.multimodal import chunk_embeds, overlaps_image, rope_positions, rope_shift
from hybridcache.sampling import (
    SamplingParams,
    TokenLogprob,
    filtered_probs,
    logprob_ranks,
    masked,
    process_logits,
    to_device,
)
from hybridcache.scheduler.output import ScheduledChunk
from hybridcache.scheduler.sequence import Seq


@dataclass(frozen=True)
class Verdict:
    """One sampled sequence of a step: `tokens` = its accepted drafts, then the token sampled after them
    (`num_accepted` + 1 tokens); `num_drafts`: the drafts it fed (0 for a row that verified nothing);
    `logprobs`: one `TokenLogprob` per token when the sequence asks for logprobs (from the target's raw logits
    at the token's position, as without speculation), else None."""

    seq: Seq
    tokens: tuple[int, ...]
    num_drafts: int
    logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


class _Prefix(Sequence[int]):
    """The first `end` tokens of `tokens` followed by `drafts`, without copying `tokens` (a verify row has one
    position row per draft, and a long sequence's tokens would be copied for each)."""

    def __init__(self, tokens: list[int], end: int, drafts: Sequence[int]) -> None:
        self.tokens, self.end, self.drafts = tokens, end, drafts

    def __len__(self) -> int:
        return self.end + len(self.drafts)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            head = self.tokens[start: min(stop, self.end)] if start < self.end else []
            return head + list(self.drafts[max(start - self.end, 0): max(stop - self.end, 0)])
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.tokens[index] if index < self.end else self.drafts[index - self.end]


@dataclass
class _PositionRow:
    """A `SamplingRow` for position j of a verify row: the sequence's tokens with its first j drafts after them
    (min_tokens counts them, the penalties count them as output tokens)."""

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: Sequence[int]
    prompt_len: int


@dataclass
class SpecDecodeStats:
    """Running totals, vLLM's spec_decode counters: verify rows (`num_drafts`), draft tokens fed, draft tokens
    accepted, and accepted tokens by draft position (index j: drafts accepted at position j + 1)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def count(self, verdict: Verdict) -> None:
        if not verdict.num_drafts:
            return
        self.num_drafts += 1
        self.num_draft_tokens += verdict.num_drafts
        self.num_accepted_tokens += verdict.num_accepted
        for j in range(verdict.num_accepted):
            self.accepted_per_position[j] += 1


GrammarMasks = Callable[[Seq, Sequence[int], int], torch.Tensor | None]
"""(sequence, its drafts, vocabulary size) -> the grammar bitmask of its verify row's positions, [drafts + 1,
ceil(vocab/32)] int32 (`OutputProcessor.draft_bitmask`), or None when the sequence is unconstrained."""


def judge(chunks: Sequence[ScheduledChunk], logits: torch.Tensor, sample_only: Sequence[Seq],
          sample_only_logits: torch.Tensor | None, *, stop_token_ids: Sequence[int],
          grammar_masks: GrammarMasks | None = None) -> list[Verdict]:
    """The tokens of every sequence a step samples: the chunks that sample, in order, then `sample_only` (zero-
    prefill hits, one row each of `sample_only_logits`). `logits`: the runner's rows (row i at chunk i's last
    token, then prompt-logprob rows, then the draft rows of every verify row in chunk order: its positions
    before the last). `grammar_masks`: the structured-output masks of a sequence's positions; the raw logits are
    masked with them before anything else, as `sample_async` masks them (the tokens, and the logprobs, are those of
    the masked logits)."""
    total_drafts = sum(c.num_drafts for c in chunks)
    draft_row = logits.shape[0] - total_drafts
    rows: list[int] = []
    views: list[_PositionRow] = []
    spans: list[tuple[Seq, list[int], int]] = []  # (sequence, its drafts, first of its rows in `rows`)
    for i, chunk in enumerate(chunks):
        if chunk.num_drafts:
            first, draft_row = draft_row, draft_row + chunk.num_drafts
        if not chunk.samples:
            continue
        seq = chunk.seq
        drafts = list(chunk.token_ids[chunk.num_tokens - chunk.num_drafts:]) if chunk.num_drafts else []
        spans.append((seq, drafts, len(rows)))
        rows += [*range(first, first + len(drafts))] if drafts else []
        rows.append(i)
        end = chunk.end - chunk.num_drafts
        views += [_PositionRow(seq.params, seq.generator, _Prefix(seq.token_ids, end, drafts[:j]), seq.prompt_len)
                  for j in range(len(drafts) + 1)]
    parts = [logits.index_select(0, to_device(rows, logits.device))] if rows else []
    for j, seq in enumerate(sample_only):
        spans.append((seq, [], len(rows) + j))
        views.append(_PositionRow(seq.params, seq.generator, list(seq.token_ids), seq.prompt_len))
    if sample_only:
        parts.append(sample_only_logits)
    if not parts:
        return []
    raw = torch.cat(parts) if len(parts) > 1 else parts[0]
    bitmask = _grammar_bitmask(spans, raw, grammar_masks) if grammar_masks is not None else None
    if bitmask is not None:
        raw = masked(raw.float(), bitmask)
    scores = process_logits(raw, views, stop_token_ids=stop_token_ids, guided=bitmask is not None)
    params = [v.params for v in views]
    greedy = scores.argmax(dim=-1).tolist()
    probs = filtered_probs(scores, params) if not all(p.greedy for p in params) else None
    verdicts = []
    for seq, drafts, first in spans:
        tokens = _judge_row(seq, drafts, first, greedy, probs)
        logprobs = None if seq.params.logprobs is None else _logprobs(raw[first: first + len(tokens)], tokens,
                                                                      seq.params.logprobs)
        verdicts.append(Verdict(seq, tokens, len(drafts), logprobs))
    return verdicts


def _grammar_bitmask(spans: list[tuple[Seq, list[int], int]], raw: torch.Tensor,
                     grammar_masks: GrammarMasks) -> torch.Tensor | None:
    """The bitmask of every row of `raw` (all bits set in the rows of unconstrained sequences), or None when no
    sequence is constrained."""
    vocab = raw.shape[1]
    masks = [(first, grammar_masks(seq, drafts, vocab)) for seq, drafts, first in spans]
    if all(mask is None for _, mask in masks):
        return None
    bitmask = torch.full((raw.shape[0], (vocab + 31) // 32), -1, dtype=torch.int32)
    for first, mask in masks:
        if mask is not None:
            bitmask[first: first + mask.shape[0]] = mask
    return bitmask


def _logprobs(raw: torch.Tensor, tokens: tuple[int, ...], k: int) -> tuple[TokenLogprob, ...]:
    """Each token's log-probability under its row of raw logits [n, vocab], its rank there and the row's k likeliest
    tokens."""
    logprobs = torch.log_softmax(raw.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=raw.device).unsqueeze(1))
    ranks = logprob_ranks(logprobs, chosen).tolist()
    chosen = chosen.squeeze(1).tolist()
    values, ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
    return tuple(TokenLogprob(token, chosen[j], ranks[j], tuple(zip(ids[j], values[j])))
                 for j, token in enumerate(tokens))


def _judge_row(seq: Seq, drafts: list[int], first: int, greedy: list[int], probs: torch.Tensor | None) -> tuple:
    """Accepted drafts then the final token of one sequence whose positions are rows first .. first + n: at each
    position the token the target takes there (greedy: the argmax; random: one draw from p, module docstring),
    the draft kept while it equals that token."""
    def take(row: int) -> int:
        return greedy[row] if seq.params.greedy else _draw(probs[row], seq.generator)

    out: list[int] = []
    for j, draft in enumerate(drafts):
        token = take(first + j)
        if token != draft:
            return (*out, token)
        out.append(token)
    return (*out, take(first + len(drafts)))


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from `probs` [vocab] fp32 by `sample_async`'s exponential race (argmax of probs / E, E ~
    Exp(1) per entry from `generator`): the same token, and the same use of the generator, as a step without
    drafts."""
    noise = torch.empty_like(probs)
    if generator is None:
        noise.exponential_()
    else:
        noise.exponential_(generator=generator)
    return int((probs / noise).argmax().item())


def assign_drafts(drafted: Sequence[int], proposers: Sequence[Sequence[ScheduledChunk]],
                  wanted: dict[int, int]) -> dict[int, list[int]]:
    """seq_id -> its drafts, from `runner.draft`'s tokens `drafted` (position by position: `proposers[j]` the chunks
    whose sequences proposed at position j, in order), each cut at the sequence's `wanted` count (a sequence that
    wants none, e.g. one that finished, gets no entry)."""
    out: dict[int, list[int]] = {}
    for owners in proposers:
        for chunk, token in zip(owners, drafted, strict=False):
            seq_id = chunk.seq.seq_id
            if len(out.get(seq_id, ())) < wanted.get(seq_id, 0):
                out.setdefault(seq_id, []).append(token)
        drafted = drafted[len(owners):]
    return out


def _on_image(chunk: ScheduledChunk) -> bool:
    """Whether `chunk`'s positions overlap an image span of its sequence (rows with 3-D M-RoPE positions)."""
    spans = chunk.seq.mm_inputs
    return bool(spans) and overlaps_image(spans, chunk.start, chunk.end)


def _head_rows(seq: Seq, token_ids: Sequence[int], start: int, chunk: ScheduledChunk) -> SeqChunk:
    """The head's rows at positions start .. start + len(token_ids) - 1 of `seq`, in `chunk`'s blocks and slot,
    rotated as the target rotates those positions: a sequence with images gives them its M-RoPE positions (3-D
    where they overlap an image, else the index moved by the images before it), as the scheduler's chunks do
    (`ScheduledChunk.rope_positions` / `rope_shift`); vLLM's MTP proposer too passes the target's M-RoPE
    positions to its draft model. Row p reads the token at p + 1, so a row whose p + 1 is an image position is
    fed the image's embedding there (`SeqChunk.embeds`: the spans' rows shifted by one), as the target was fed
    it; vLLM's MTP model embeds its inputs with the image embeddings too (gathered one position on)."""
    spans = seq.mm_inputs
    if not spans:
        return SeqChunk(token_ids=token_ids, start=start, block_ids=chunk.block_ids, slot=chunk.slot)
    end = start + len(token_ids)
    return SeqChunk(token_ids=token_ids, start=start, block_ids=chunk.block_ids, slot=chunk.slot,
                    embeds=chunk_embeds(spans, start + 1, end + 1),
                    rope_positions=rope_positions(spans, start, end) if overlaps_image(spans, start, end) else None,
                    rope_shift=rope_shift(spans, start))


def _plain_greedy(params: SamplingParams) -> bool:
    """Greedy, and the greedy token is the raw logits' argmax (no grammar, bias, min_tokens or penalties), with no
    logprobs asked (`judge`)."""
    return (params.greedy and params.guided is None and not params.logit_bias and not params.min_tokens
            and not params.penalized and params.logprobs is None)


class MtpDrafter:
    """Proposes drafts with the MTP head through the executor seam: `propose` builds the head's work after a step
    on the host (a `DraftPlan`, `engine/mtp_draft.py`) and `runner.draft(plan)` runs it on the device, on one
    runner or, under tensor parallelism, on every rank in lock step, with each rank's shard of the head, its
    pools and the hidden states its last forward kept. `runner`: the engine's `Executor` (`draft`, `draft_slots`,
    `input_device`); `page_rows`: the engine's `PageRows` (the head's rows are in its chunks' blocks and slots, so
    their block-table rows are the step's)."""

    def __init__(self, runner, *, num_speculative_tokens: int, block_size: int, kernel_block_size: int,
                 max_model_len: int, page_rows: PageRows) -> None:
        self.runner = runner
        self.page_rows = page_rows
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.kernel_block_size = kernel_block_size
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(accepted_per_position=[0] * num_speculative_tokens)

    def draft_slots(self, chunks: Sequence[ScheduledChunk]) -> list[tuple[int, ...]]:
        """Per chunk, the state pool rows of its draft states (`build_forward_batch(draft_slots=...)`)."""
        return [self.runner.draft_slots(c.slot, c.num_drafts) for c in chunks]

    def budget(self, seq: Seq) -> int:
        """How many drafts `seq` may feed next: k, fewer only near max_model_len (a verify row of n drafts writes
        n + 1 positions, which must stay within the sequence's blocks). Not cut near max_tokens: the engine stops
        emitting at max_tokens (`OutputProcessor`), so a row's extra drafts only cost their positions, and every
        row of a step keeps k drafts: the step stays uniform, graphed (verify and drafting)."""
        return max(0, min(self.k, self.max_model_len - seq.num_tokens - 1))

    def greedy_verify(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether a step's drafting can be planned on the device before its verdicts
        (`runner.draft_after_verify`): every chunk a verify row of k drafts that samples, greedily with nothing
        that changes the argmax or asks for more than it (a grammar, logit bias, min_tokens, penalties, logprobs)."""
        return bool(chunks) and all(
            c.num_drafts == self.k and c.num_tokens == 1 + self.k and c.samples and _plain_greedy(c.seq.params)
            for c in chunks)

    def near_pages(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """[n, W] int64 on the runner's device: each chunk's kernel pages from the page of its first position on,
        as far as its drafts after the step reach (start + 2k; 0 past its blocks), for `draft_after_verify`."""
        per_block = self.block_size // self.kernel_block_size
        width = (2 * self.k - 1) // self.kernel_block_size + 2
        rows = []
        for chunk in chunks:
            first = chunk.start // self.kernel_block_size
            pages = [chunk.block_ids[p // per_block] * per_block + p % per_block
                     for p in range(first, first + width) if p // per_block < len(chunk.block_ids)]
            rows.append(pages + [0] * (width - len(pages)))
        return to_device(rows, self.runner.input_device, torch.int64)

    def propose(self, chunks: Sequence[ScheduledChunk], drafting: Sequence[Seq],
                predrafted: torch.Tensor | None = None) -> None:
        """After a step's tokens are settled (`Seq.token_ids` and `num_computed` advanced, the verdicts' drafts
        accepted): run the head over every position the step computed (its KV there; for a sequence that finished
        in the step too, whose blocks and tail the cache keeps), then set `seq.drafts` of each sequence in
        `drafting` (running, sampled in this step) to the `budget(seq)` tokens the head proposes greedily (a uniform
        plan drafts k for every sequence: the drafts past a budget are dropped here).

        The head's KV goes into the blocks the step was planned with (`chunk.block_ids`, like the forward's), at
        positions the step computed and, for the further drafts, past them (private blocks: the scheduler's 3k of
        lookahead). It is queued before the next step is planned, so a block `accept` has just put into
        the trie (or freed as a duplicate) is written before any other sequence can share or reuse it.

        `predrafted`: the step's drafting, already queued on the device before its verdicts
        (`runner.draft_after_verify`, the chunks' accepted counts then their drafts): its drafts are taken when
        its counts equal the verdicts' (they do: the same argmax of the same logits), else the head runs again."""
        for seq in drafting:
            seq.drafts = []
        wanted = {seq.seq_id: self.budget(seq) for seq in drafting}
        if predrafted is not None and self._take_predrafted(chunks, drafting, wanted, predrafted.tolist()):
            return
        planned = self.plan(chunks, wanted)
        if planned is None:
            return
        plan, proposers = planned
        drafted = self.runner.draft(plan).tolist()  # one host transfer for every draft of the step
        assigned = assign_drafts(drafted, proposers, wanted)
        for seq in drafting:
            seq.drafts = assigned.get(seq.seq_id, [])

    def _take_predrafted(self, chunks: Sequence[ScheduledChunk], drafting: Sequence[Seq], wanted: dict[int, int],
                         values: list[int]) -> bool:
        """Set the drafts of `drafting` from `draft_after_verify`'s `values`; False (nothing set) when a count
        disagrees with the sequence's settled tokens (`num_computed` = start + 1 + accepted)."""
        n, drafted = len(chunks), set(drafting)
        counts, tokens = values[:n], values[n:]
        if any(c.seq.num_computed != c.start + 1 + counts[i] for i, c in enumerate(chunks) if c.seq in drafted):
            return False
        for i, chunk in enumerate(chunks):
            if chunk.seq in drafted:
                chunk.seq.drafts = [tokens[j * n + i] for j in range(wanted[chunk.seq.seq_id])]
        return True

    def plan(self, chunks: Sequence[ScheduledChunk],
             wanted: dict[int, int]) -> tuple[DraftPlan, list[list[ScheduledChunk]]] | None:
        """The head's work after the step (`propose`; `wanted`: seq_id -> drafts wanted, for the sequences that
        draft), built on the runner's `input_device`, and the chunks whose sequences propose at each position,
        in the order of `runner.draft`'s tokens; None when no sequence computed a position.
        Uniform (`mtp_draft` module docstring) when every such chunk sampled and fed the same q tokens, q = 1 (a
        plain decode row) or 1 + k (a verify row of k drafts): its further rows, one per chunk and step, lie in the
        scheduler's lookahead blocks, which only a chunk that samples has (a prefill chunk that does not gets
        catch-up rows alone, in the ragged plan), and no chunk overlaps an image (a uniform plan's rows are text:
        their M-RoPE positions are one shifted index, which a drafting graph takes as its positions).
        Every row rotates as the target's row at its position does (`_head_rows`)."""
        # (a sequence that finished in this step too: its blocks and tail go into the cache, the head's KV with them)
        owners = [c for c in chunks if c.seq.num_computed > c.start and len(c.seq.token_ids) > c.seq.num_computed]
        if not owners:
            return None
        widths = {c.num_tokens for c in owners}
        q = next(iter(widths))
        if (len(widths) == 1 and all(c.samples and c.num_drafts == q - 1 for c in owners)
                and q - 1 in (0, self.k) and not any(_on_image(c) for c in owners)):
            return self._uniform_plan(chunks, owners, q), [owners] * self.k
        return self._ragged_plan(chunks, owners, wanted)

    def _uniform_plan(self, chunks: Sequence[ScheduledChunk], owners: list[ScheduledChunk], q: int) -> DraftPlan:
        """q catch-up rows per sequence in `owners` (its chunk's positions; a row past the sequence's last
        computed position is fed token 0), k drafts each."""
        device = self.runner.input_device
        rows: list[SeqChunk] = []
        hidden_rows: list[int] = []
        first: list[int] = []
        offsets, row = {}, 0
        for chunk in chunks:
            offsets[id(chunk)], row = row, row + chunk.num_tokens
        for i, chunk in enumerate(owners):
            seq = chunk.seq
            tokens = seq.token_ids[chunk.start + 1: seq.num_computed + 1]
            rows.append(_head_rows(seq, [*tokens, *[0] * (q - len(tokens))], chunk.start, chunk))
            hidden_rows += range(offsets[id(chunk)], offsets[id(chunk)] + q)
            first.append(i * q + len(tokens) - 1)
        steps = []
        for step in range(1, self.k):
            further = [_head_rows(c.seq, [0], c.seq.num_computed + step - 1, c) for c in owners]
            steps.append(DraftStep(self._batch(further, device)))
        return DraftPlan(self._batch(rows, device), to_device(hidden_rows, device, torch.int64),
                         to_device(first, device, torch.int64), tuple(steps), tokens_per_seq=q)

    def _ragged_plan(self, chunks: Sequence[ScheduledChunk], owners: list[ScheduledChunk],
                     wanted: dict[int, int]) -> tuple[DraftPlan, list[list[ScheduledChunk]]]:
        """The catch-up rows of the positions that hold tokens, and further steps only for the sequences whose
        budgets reach them."""
        device = self.runner.input_device
        owned = {id(c) for c in owners}
        caught: list[SeqChunk] = []
        hidden_rows: list[int] = []
        last_rows: list[int] = []
        row, step_rows, reads_prior = 0, sum(c.num_tokens for c in chunks), False
        for index, chunk in enumerate(chunks):
            seq = chunk.seq
            if id(chunk) in owned:
                valid = seq.num_computed - chunk.start  # positions of the chunk that hold the sequence's tokens
                start, rows = chunk.start, list(range(row, row + valid))
                if self._redo_before(chunk):  # the head's KV at start - 1 from this sequence's token at start
                    start, rows, reads_prior = start - 1, [step_rows + index, *rows], True
                caught.append(_head_rows(seq, seq.token_ids[start + 1: seq.num_computed + 1], start, chunk))
                hidden_rows += rows
                last_rows.append(len(hidden_rows) - 1)
            row += chunk.num_tokens
        first = [i for i, c in enumerate(owners) if wanted.get(c.seq.seq_id, 0) > 0]
        active = [owners[i] for i in first]
        proposers = [active] if active else []
        steps: list[DraftStep] = []
        for step in range(1, max((wanted[c.seq.seq_id] for c in active), default=0)):
            keep = [j for j, c in enumerate(active) if wanted[c.seq.seq_id] > step]
            if not keep:
                break
            active = [active[j] for j in keep]
            rows = [_head_rows(c.seq, [0], c.seq.num_computed + step - 1, c)
                    for c in active]  # (the token is the draft proposed before, embedded on the device)
            steps.append(DraftStep(self._batch(rows, device), to_device(keep, device, torch.int64)))
            proposers.append(active)
        plan = DraftPlan(self._batch(caught, device), to_device(hidden_rows, device, torch.int64),
                         to_device([last_rows[i] for i in first], device, torch.int64), tuple(steps),
                         reads_prior=reads_prior)
        return plan, proposers

    def _redo_before(self, chunk: ScheduledChunk) -> bool:
        """Whether the head's catch-up for `chunk` starts one position early: the chunk starts where its sequence
        hit the cache, inside a block (a checkpoint's restored tail, the sequence's own block). The head's KV at
        s - 1 reads the token at s, and the request that saved the checkpoint may have had another there (a branch
        point is where two prompts part): it is written again from this sequence's token and the hidden state the
        checkpoint restored (the runner's `step_prior`; `DraftPlan.reads_prior`). At a block boundary position
        s - 1 is in a shared block, which stays as it is (the drafts then read the other request's KV there)."""
        seq = chunk.seq
        return bool(seq.num_cached) and chunk.start == seq.num_cached and chunk.start % self.block_size != 0

    def _batch(self, rows: Sequence[SeqChunk], device: torch.device) -> ForwardBatch:
        return build_forward_batch(rows, block_size=self.block_size, kernel_block_size=self.kernel_block_size,
                                   device=device, page_rows=self.page_rows)
