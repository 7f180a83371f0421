"""The MTP head's drafting captured in CUDA graphs: one graph per batch bucket and catch-up width, replaying a
uniform `DraftPlan` (`engine/mtp_draft.py`) with no host read between its drafts.

A uniform plan of n sequences, k drafts, q catch-up rows per sequence (q = 1 after a plain decode step, 1 + k after
a verify step) runs in the graph of the smallest bucket b >= n captured for q::

    catch-up   b * q rows: input ids, positions, KV rows, block tables, context lengths copied into static buffers
               (rows past n * q: padding), the target's hidden rows gathered into a static buffer, `first` (each
               sequence's proposing row) into another; the head over them, the proposing rows' argmaxes
    step i     b one-token rows (static buffers of their own), fed the argmax of the step before on the device
               (embedding and head), for i = 1 .. k - 1; each step's argmax kept
    tokens     [k, b] int64: the proposals by position; rows n..b-1 dropped (`run`)

A padding sequence is a fresh one (q tokens at positions 0 .. q - 1, or one at position 0) on the scratch page and
the scratch slot the runner keeps for its decode graphs' padding: its KV writes reach no real sequence. The head's
kernels read every length from device tensors, so one capture serves every step of its bucket: the static batches
claim `max_context_len` (max_model_len + 2k, the furthest a draft reaches) for their first row, so backends that size
work from the longest context cover every replay, as the runner's decode graphs do.

Only one device captures (no tensor parallelism): under it each further draft is agreed by a broadcast from rank 0
(`mtp_draft` module docstring), which the runner keeps eager. Plans that are not uniform run eagerly too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridcache.engine.mtp_draft import DraftPlan, draft_chain, head_kv
from hybridcache.forward_batch import ForwardBatch, table_width
from hybridcache.kernels.backend import KernelBackend
from hybridcache.state_spec import DevicePools


class _StaticRows:
    """Static buffers for up to `biggest` sequences of q rows each (one batch kind of a draft graph) and their
    padding (module docstring)."""

    def __init__(self, biggest: int, q: int, *, num_pages: int, max_context_len: int, scratch_slot: int,
                 scratch_page: int, kernel_block_size: int, device: torch.device) -> None:
        if q > kernel_block_size:
            raise ValueError(f"draft graphs of {q} rows per sequence need a page of >= {q} tokens "
                             f"(got {kernel_block_size})")
        self.q = q
        self.max_context_len = max_context_len
        self.scratch_slot = scratch_slot
        self.scratch_page = scratch_page
        within = torch.arange(biggest * q, device=device) % q
        self.pad_positions = within
        self.pad_kv_rows = scratch_page * kernel_block_size + within
        self.input_ids = torch.zeros(biggest * q, dtype=torch.int64, device=device)
        self.positions = self.pad_positions.clone()
        self.kv_rows = self.pad_kv_rows.clone()
        self.state_slots = torch.full((biggest,), scratch_slot, dtype=torch.int64, device=device)
        self.context_lens = torch.full((biggest,), q, dtype=torch.int32, device=device)
        self.block_tables = torch.full((biggest, table_width(num_pages)), scratch_page, dtype=torch.int32,
                                       device=device)
        self.cu_seqlens = torch.arange(biggest + 1, dtype=torch.int32, device=device) * q
        self.logits_indices = torch.arange(1, biggest + 1, dtype=torch.int64, device=device) * q - 1

    def static_batch(self, size: int, context_lens_cpu: Sequence[int] | None = None) -> ForwardBatch:
        """The batch of `size` sequences on the static buffers. Host context lengths: `context_lens_cpu` when given
        (an eager run on the host-looping reference backend needs the true ones), else the capture's claim (the
        first row `max_context_len`)."""
        q = self.q
        lens = (tuple(context_lens_cpu) if context_lens_cpu is not None
                else (self.max_context_len,) + (q,) * (size - 1))
        return ForwardBatch(
            input_ids=self.input_ids[: size * q], positions=self.positions[: size * q],
            cu_seqlens=self.cu_seqlens[: size + 1], context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size], kv_rows=self.kv_rows[: size * q],
            state_slots=self.state_slots[:size], logits_indices=self.logits_indices[:size],
            query_lens_cpu=(q,) * size, context_lens_cpu=lens,
        )

    def load(self, batch: ForwardBatch, size: int) -> None:
        """Copy `batch` (n <= size sequences of q rows each) into the buffers; sequences n..size-1 become padding.
        The positions buffer holds the rows' rotary positions (the head reads it for nothing else): a uniform plan's
        rows are text, so where the batch has M-RoPE positions (a sequence with images: the index moved by its
        images) they are one row's, equal on the three axes, and the rotary of that row is the rotary of all three,
        as in the runner's decode graphs."""
        rotary = batch.positions if batch.rope_positions is None else batch.rope_positions[0]
        self.write(batch.input_ids, rotary, batch.kv_rows, batch.state_slots, batch.context_lens,
                   batch.block_tables, size)

    def write(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_rows: torch.Tensor,
              state_slots: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor, size: int) -> None:
        """`load` from device tensors of n <= size sequences (a `ForwardBatch`'s fields)."""
        write_rows(self, self.q, input_ids, positions, kv_rows, state_slots, context_lens, block_tables, size)


def write_rows(buffers, q: int, input_ids: torch.Tensor, positions: torch.Tensor, kv_rows: torch.Tensor,
               state_slots: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor, size: int) -> None:
    """Copy n <= size sequences of q rows each into a graph's static `buffers` (the attributes `input_ids`,
    `positions`, `kv_rows`, `state_slots`, `context_lens`, `block_tables`, with `pad_positions`, `pad_kv_rows`,
    `scratch_slot` and `scratch_page` for padding: `_StaticRows`, and the runner's decode and verify graphs);
    sequences n..size-1 become padding: fresh q-token sequences on the scratch slot and page."""
    n = state_slots.shape[0]
    used, total = n * q, size * q
    width = block_tables.shape[1]
    buffers.input_ids[:used].copy_(input_ids, non_blocking=True)
    buffers.positions[:used].copy_(positions, non_blocking=True)
    buffers.kv_rows[:used].copy_(kv_rows, non_blocking=True)
    buffers.state_slots[:n].copy_(state_slots, non_blocking=True)
    buffers.context_lens[:n].copy_(context_lens, non_blocking=True)
    buffers.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
    if n < size:
        buffers.input_ids[used:total] = 0
        buffers.positions[used:total] = buffers.pad_positions[used:total]
        buffers.kv_rows[used:total] = buffers.pad_kv_rows[used:total]
        buffers.state_slots[n:size] = buffers.scratch_slot
        buffers.context_lens[n:size] = q
        buffers.block_tables[n:size, 0] = buffers.scratch_page


class DraftGraphs:
    """The drafting of uniform plans with `num_drafts` (k) drafts per sequence, per bucket of `sizes` and per
    catch-up width q in (1, 1 + k) (1 + k only when a page holds it), on the runner's `pools` (the head's KV
    layers: `head_kv`) with its `backend` (module docstring). `capture` records the graphs (CUDA); without it
    `run` replays nothing and runs the same work eagerly on the static buffers (what the CPU tests check)."""

    def __init__(self, *, head: torch.nn.Module, model: torch.nn.Module, pools: DevicePools, backend: KernelBackend,
                 num_drafts: int, sizes: tuple[int, ...], max_model_len: int, scratch_slot: int, scratch_page: int,
                 kernel_block_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.head, self.model, self.backend = head, model, backend
        self.kv = head_kv(model, pools)
        self.k = k = num_drafts
        self.kernel_block_size = kernel_block_size
        self.sizes = sizes
        biggest = sizes[-1]
        max_context_len = max_model_len + 2 * k
        num_pages = -(-max_context_len // kernel_block_size)

        def rows(q: int) -> _StaticRows:
            return _StaticRows(biggest, q, num_pages=num_pages, max_context_len=max_context_len,
                               scratch_slot=scratch_slot, scratch_page=scratch_page,
                               kernel_block_size=kernel_block_size, device=device)

        widths = (1, 1 + k) if 1 + k <= kernel_block_size else (1,)
        self.catch = {q: rows(q) for q in widths}
        self.further = [rows(1) for _ in range(k - 1)]  # shared by both widths: one graph replays at a time
        self.hidden = {q: torch.zeros(biggest * q, hidden_size, dtype=dtype, device=device) for q in widths}
        self.pad_first = {q: torch.arange(biggest, device=device) * q + q - 1 for q in widths}
        self.first = {q: first.clone() for q, first in self.pad_first.items()}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.tokens: dict[tuple[int, int], torch.Tensor] = {}
        self.prepared: dict[tuple[int, int], tuple[ForwardBatch, list[ForwardBatch]]] = {}
        self.pool = None

    def bucket(self, plan: DraftPlan) -> int | None:
        """The bucket that replays `plan`, or None when it is not a uniform plan of these graphs' k and widths,
        or has more sequences than the biggest bucket."""
        q = plan.tokens_per_seq
        if q not in self.catch or len(plan.steps) != self.k - 1 or plan.batch.embeds is not None:
            return None
        return next((size for size in self.sizes if size >= plan.batch.num_seqs), None)

    @torch.inference_mode()
    def run(self, plan: DraftPlan, hidden: torch.Tensor, size: int, *, replay: bool = True) -> torch.Tensor:
        """The proposed tokens of uniform `plan` (`run_draft_plan`'s order: by position, then sequence) from the
        target's hidden rows `hidden`, in bucket `size` (`bucket(plan)`): its inputs loaded into the static buffers,
        then the graph replayed (`replay` and captured), else the same work run eagerly on the buffers
        (`replay_or_run`)."""
        q, n = plan.tokens_per_seq, plan.batch.num_seqs
        self.catch[q].load(plan.batch, size)
        self.hidden[q][: n * q].copy_(hidden.index_select(0, plan.hidden_rows))
        self.first[q][:n].copy_(plan.first, non_blocking=True)
        self.first[q][n:size] = self.pad_first[q][n:size]
        for rows, step in zip(self.further, plan.steps, strict=True):
            rows.load(step.batch, size)
        tokens = self.replay_or_run(q, size, replay, lambda: (
            plan.batch.context_lens_cpu, [step.batch.context_lens_cpu for step in plan.steps]))
        return tokens.view(self.k, size)[:, :n].reshape(-1)

    @torch.inference_mode()
    def run_after_verify(self, batch: ForwardBatch, logits: torch.Tensor, hidden: torch.Tensor,
                         near_pages: torch.Tensor, size: int, *, replay: bool = True) -> torch.Tensor:
        """The drafts after a uniform verify step whose rows are all greedy, planned on the device without the
        host's verdicts: `batch` the step's n verify rows of k drafts, `logits` its rows (n last rows, then n * k
        draft rows: `ModelRunner.execute`), `hidden` its final-norm hidden rows (token order), `near_pages`
        [n, W] int64 the kernel pages of each row from the page of its first position on (the further drafts reach
        past the step's block table), `size` the bucket of n. Each row accepts its drafts while they equal the
        target's argmax (`speculative.judge`'s greedy rule), so the catch-up rows are fed the argmaxes (row j's
        token at position start + j + 1: an accepted draft, then the final token, then placeholders), the
        proposing row is the last accepted, and the further steps sit right after it. Returns int64
        [n + k * n + n * (1 + k)]: each row's accepted count, then the drafts as `run` orders them (the caller
        checks the counts against its verdicts), then the target's argmax at each row's positions, row by row (the
        row's accepted drafts and its final token: `spec_chain`). Rows of sequences with images rotate by their
        M-RoPE positions (`batch.rope_positions`: verify rows are text, their index moved by the images before)."""
        k, q, n = self.k, 1 + self.k, batch.num_seqs
        rotary = None if batch.rope_positions is None else batch.rope_positions[0]
        accepted, target, last = self.load_after_verify(
            batch.input_ids, batch.positions, batch.kv_rows, batch.state_slots, batch.context_lens,
            batch.block_tables, logits, hidden, near_pages, size, rotary=rotary)

        def host_lens() -> tuple[tuple[int, ...], list[tuple[int, ...]]]:  # (host-looping backends: a sync)
            ends = (last + 1).tolist()
            return batch.context_lens_cpu, [tuple(end + step for end in ends) for step in range(1, k)]

        tokens = self.replay_or_run(q, size, replay, host_lens)
        return torch.cat([accepted, tokens.view(k, size)[:, :n].reshape(-1), target.reshape(-1)])

    def load_after_verify(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_rows: torch.Tensor,
                          state_slots: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                          logits: torch.Tensor, hidden: torch.Tensor, near_pages: torch.Tensor,
                          size: int, rotary: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
        """`run_after_verify`'s inputs of the drafting graph (q = 1 + k, bucket `size`) from a verify step's n <=
        size rows (the `ForwardBatch` fields, `logits` its n last rows then n * k draft rows, `hidden`, `near_pages`),
        all on the device (what `spec_chain.ChainGraphs` captures with n = size); returns each row's accepted count,
        the target's argmax at each of its positions [n, 1 + k] and its last accepted position. `rotary`: the rows'
        rotary positions where they are not `positions` (text rows of sequences with images: their M-RoPE index);
        each row's further drafts then rotate at the same shift from their positions."""
        k, q, n = self.k, 1 + self.k, state_slots.shape[0]
        greedy = logits.argmax(dim=-1)
        target = torch.cat([greedy[n: n + n * k].view(n, k), greedy[:n, None]], dim=1)  # the argmax at each position
        accepted = (input_ids.view(n, q)[:, 1:] == target[:, :k]).cumprod(dim=1).sum(dim=1)
        self.catch[q].write(target.reshape(-1), positions if rotary is None else rotary, kv_rows, state_slots,
                            context_lens, block_tables, size)
        self.hidden[q][: n * q].copy_(hidden[: n * q])
        self.first[q][:n] = self.pad_first[q][:n] - (q - 1) + accepted
        self.first[q][n:size] = self.pad_first[q][n:size]
        page_size = self.kernel_block_size
        first_page = positions.view(n, q)[:, 0] // page_size
        last = positions.view(n, q)[:, 0] + accepted  # each row's last accepted position
        shift = None if rotary is None else (rotary - positions).view(n, q)[:, 0]
        for step, rows in enumerate(self.further, start=1):
            position = last + step
            column = (position // page_size)[:, None]
            page = near_pages.gather(1, column - first_page[:, None])
            rows.write(torch.zeros_like(position), position if shift is None else position + shift,
                       page.squeeze(1) * page_size + position % page_size, state_slots, (position + 1).int(),
                       block_tables, size)
            rows.block_tables[:n].scatter_(1, column, page.int())  # (the page past the step's table, if it is)
        return accepted, target, last

    def replay_or_run(self, q: int, size: int, replay: bool, host_lens) -> torch.Tensor:
        """Replay graph (q, size) on the loaded buffers, or run its work eagerly there: with the capture's host
        lengths (the same kernel choices, so the same roundings as a replay), or on a backend that cannot capture
        (the reference backend loops over them on the host) with the true ones, `host_lens()`: the catch-up
        batch's and each further step's, n sequences each."""
        key = (q, size)
        if replay and key in self.graphs:
            self.graphs[key].replay()
            return self.tokens[key]
        catch_lens, step_lens = (None, [None] * len(self.further))
        if not hasattr(self.backend, "supports_cuda_graphs"):
            catch_lens, step_lens = host_lens()
            pad = size - len(catch_lens)
            catch_lens = (*catch_lens, *(q,) * pad)
            step_lens = [(*lens, *(1,) * pad) for lens in step_lens]
        catch = self.catch[q].static_batch(size, catch_lens)
        steps = [rows.static_batch(size, lens) for rows, lens in zip(self.further, step_lens, strict=True)]
        return self._chain(q, size, self.backend.prepare(catch), [self.backend.prepare(s) for s in steps])

    def capture(self, pool=None) -> None:
        """Capture one graph per width and bucket, largest bucket first (smaller ones reuse its memory pool;
        `pool`: a memory pool to share, the runner's decode graphs'), each run once eagerly first (kernel
        compilation) on its all-padding static batches, which are kept: the graphs read what `prepare` allocated."""
        device = next(iter(self.hidden.values())).device
        keys = [(q, size) for q in self.catch for size in reversed(self.sizes)]
        for key in keys:
            q, size = key
            self.prepared[key] = (self.backend.prepare(self.catch[q].static_batch(size)),
                                  [self.backend.prepare(rows.static_batch(size)) for rows in self.further])
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for key in keys:
                self._chain(*key, *self.prepared[key])
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        self.pool = pool
        with torch.inference_mode():
            for key in keys:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.tokens[key] = self._chain(*key, *self.prepared[key])
                self.pool = graph.pool()
                self.graphs[key] = graph
        torch.cuda.synchronize(device)

    def reset(self) -> None:
        """Destroy the captured graphs (later runs are eager on the static buffers)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def _chain(self, q: int, size: int, catch: ForwardBatch, steps: Sequence[ForwardBatch]) -> torch.Tensor:
        return draft_chain(catch, self.hidden[q][: size * q], self.first[q][:size], [(s, None) for s in steps],
                           head=self.head, model=self.model, kv=self.kv, backend=self.backend)
