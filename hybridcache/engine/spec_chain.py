"""Async (overlapped) speculative steps: the next verify step built on the device from a step's device verdicts.

A uniform, all-greedy verify step t (every row its last token and k drafts, `MtpDrafter.greedy_verify`) leaves on the
device, before the host has judged it (`runner.draft_after_verify`): each row's accepted count a, the drafts of the
next step, and the target's argmax at each of its 1 + k positions (`DeviceVerdicts.values`). Step t + 1 of a row
that t started at position s feeds [t's final token, t + 1's k drafts] at positions s + a + 1 .. s + a + 1 + k: every
input of it is a device value, so the engine queues it before t's verdicts reach the host (`next_verify_batch`),
with the rollback of t (the state after position s + a, `select_rows`) queued right before it::

    t:      fed  x  d1 d2   at s .. s+2      target  a0 a1 a2      (k = 2; d1 == a0, d2 != a1: a = 1)
    t + 1:  fed  a1 e1 e2   at s+2 .. s+4    (a1: t's final token; e1 e2: the drafts queued after t)
            slot state <- t's draft state 1 (the state after s + 1), before t + 1's forward reads it

A row whose tokens in t end its sequence (an emitted token in its stop set) is fed as a padding row instead (the
scratch slot, its draft rows and the scratch page): its slot, its draft states and its blocks keep what t left, so
the host's rollback and finish checkpoint after t are those of a synchronous step. Host conditions under which the
engine chains (no stop strings, no length limit within reach, blocks in place, ...) are `LLMEngine._chainable`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridcache.engine.speculative import Verdict
from hybridcache.forward_batch import ForwardBatch
from hybridcache.kernels.copy.block_copy import copy_blocks
from hybridcache.sampling import to_device
from hybridcache.scheduler.output import ScheduledChunk
from hybridcache.scheduler.sequence import Seq


@dataclass
class DeviceVerdicts:
    """A uniform all-greedy verify step launched without its host verdicts. `rows`: the sequence of each of its
    batch rows, in order (a row whose sequence ended in the step before was a padding row: it is still listed);
    `batch`: the step's device batch as executed; `values`: int64 [n + k n + n (1 + k)] on the device (each row's
    accepted count, then the next drafts by position then row, then the target's argmax at each row's positions);
    `host`: their copy on the host, valid once `event` has completed (None on the CPU: `values` itself)."""

    rows: tuple[Seq, ...]
    batch: ForwardBatch
    values: torch.Tensor
    host: torch.Tensor
    event: torch.cuda.Event | None
    k: int

    @classmethod
    def queue(cls, rows: Sequence[Seq], batch: ForwardBatch, values: torch.Tensor, k: int) -> DeviceVerdicts:
        """Queue the copy of `values` to pinned host memory (CUDA; no wait) and record its completion."""
        if values.device.type != "cuda":
            return cls(tuple(rows), batch, values, values, None, k)
        with torch.inference_mode():
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(tuple(rows), batch, values, host, event, k)

    def result(self) -> list[int]:
        """The values on the host (waits for the step and its drafting only, not for later work)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()

    def verdicts(self, chunks: Sequence[ScheduledChunk], values: list[int]) -> tuple[list[Verdict], torch.Tensor]:
        """Each chunk's `Verdict` (its accepted drafts are the target's argmaxes before the first mismatch, then
        the argmax after them: `speculative.judge`'s greedy rule on the same logits) and the step's drafting in
        the order `MtpDrafter.propose` takes (`predrafted`: the chunks' counts, then their drafts by position)."""
        n, k, q = len(self.rows), self.k, 1 + self.k
        row_of = {seq.seq_id: i for i, seq in enumerate(self.rows)}
        rows = [row_of[c.seq.seq_id] for c in chunks]
        verdicts = []
        for chunk, r in zip(chunks, rows, strict=True):
            accepted = values[r]
            target = values[n + k * n + r * q: n + k * n + r * q + q]
            verdicts.append(Verdict(chunk.seq, tuple(target[: accepted + 1]), chunk.num_drafts))
        drafts = [values[n + j * n + r] for j in range(k) for r in rows]
        return verdicts, torch.tensor([values[r] for r in rows] + drafts, dtype=torch.int64)


    def next_inputs(self, values: list[int]) -> dict[int, tuple[int, ...]]:
        """seq_id -> the tokens the verify step after this one feeds for the sequence (`next_verify_batch`): its
        final token here, then the drafts queued after the step."""
        n, k, q = len(self.rows), self.k, 1 + self.k
        base = n + k * n
        return {seq.seq_id: (values[base + r * q + values[r]], *(values[n + j * n + r] for j in range(k)))
                for r, seq in enumerate(self.rows)}


def select_rows(state_slots: torch.Tensor, accepted: torch.Tensor, *, k: int, draft_base: int) -> torch.Tensor:
    """The state pool row that holds each verify row's state after its last accepted position: draft state
    `slot * k + a` (pool row `draft_base + slot * k + a`) when it accepted a < k drafts, else its slot itself."""
    drafted = draft_base + state_slots * k + accepted.clamp(max=k - 1)
    return torch.where(accepted < k, drafted, state_slots)


def copy_state_rows(state_groups: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Every state group's row `src[i]` -> row `dst[i]` (groups [layers, rows, *state]), whole rows of every layer,
    in place: the rollback of a verify step (`STATE_ROLLBACK`, and the chained step's select, where a row that
    accepted every draft copies its slot onto itself). One `copy_blocks` launch per group on CUDA, no temporary of
    all the rows (at Qwen3-Next-80B's shape an `index_select` of 64 slots' states would be ~6 GB)."""
    for group in state_groups:
        copy_blocks(group, src, dst, pages_per_block=1, page_dim=1)


def next_verify_rows(positions: torch.Tensor, state_slots: torch.Tensor, draft_slots: torch.Tensor,
                     values: torch.Tensor, tables: torch.Tensor, stops: torch.Tensor | None,
                     pad: torch.Tensor | None = None, *, k: int, kernel_block_size: int, scratch_slot: int,
                     scratch_page: int, scratch_drafts: torch.Tensor) -> dict[str, torch.Tensor]:
    """The device math of step t + 1's verify rows (`next_verify_batch`) from step t's n uniform rows (`positions`
    [n (1 + k)], `state_slots` [n], `draft_slots` [n k]) and its `values` (`DeviceVerdicts.values`, laid out for n
    rows), on the device with no host read: `input_ids`, `positions`, `kv_rows` [n, 1 + k], `state_slots` [n],
    `draft_slots` [n, k], `context_lens` [n], `block_tables` [n, P] (`tables`, a padding row's all scratch),
    `near` [n, W] (the kernel pages from each row's first position on, for the drafting) and `done` [n] bool (the
    rows fed as padding: a stop token among t's emitted tokens, or `pad`, rows that are padding anyway: a captured
    bucket's rows past the step's)."""
    n, q, kbs = state_slots.shape[0], 1 + k, kernel_block_size
    device = values.device
    accepted = values[:n].clamp(0, k)
    drafts = values[n: n + k * n].view(k, n).t()
    target = values[n + k * n: n + k * n + n * q].view(n, q)
    within = torch.arange(q, device=device)
    positions = positions.view(n, q)[:, :1] + accepted[:, None] + 1 + within[None, :]
    input_ids = torch.cat([target.gather(1, accepted[:, None]), drafts], dim=1)
    draft_slots = draft_slots.view(n, k)
    done = None
    if stops is not None:  # rows that stop in t: padding rows
        emitted = within[None, :] <= accepted[:, None]
        done = ((target[:, :, None] == stops[:, None, :]).any(dim=-1) & emitted).any(dim=1)
    if pad is not None:
        done = pad if done is None else done | pad
    if done is not None:
        positions = torch.where(done[:, None], within[None, :], positions)
        tables = torch.where(done[:, None], torch.full_like(tables, scratch_page), tables)
        input_ids = torch.where(done[:, None], 0, input_ids)
        state_slots = torch.where(done, scratch_slot, state_slots)
        draft_slots = torch.where(done[:, None], scratch_drafts[None, :], draft_slots)
    else:
        done = torch.zeros(n, dtype=torch.bool, device=device)
    kv_rows = tables.gather(1, positions // kbs) * kbs + positions % kbs
    width = (2 * k - 1) // kbs + 2
    columns = (positions[:, :1] // kbs + torch.arange(width, device=device)[None, :]).clamp(max=tables.shape[1] - 1)
    return {"input_ids": input_ids, "positions": positions, "kv_rows": kv_rows, "state_slots": state_slots,
            "draft_slots": draft_slots, "context_lens": positions[:, -1] + 1, "block_tables": tables,
            "near": tables.gather(1, columns), "done": done}


def next_verify_batch(prev: ForwardBatch, values: torch.Tensor, tables: torch.Tensor, stops: torch.Tensor | None, *,
                      k: int, kernel_block_size: int, scratch_slot: int, scratch_page: int,
                      scratch_drafts: torch.Tensor, host_lengths: bool) -> tuple[ForwardBatch, torch.Tensor]:
    """Step t + 1's verify batch (module docstring) from step t's batch `prev` (n uniform rows of 1 + k) and its
    device `values` (`DeviceVerdicts.values`), and the kernel pages each row may reach (`near_pages` of
    `runner.draft_after_verify`). `tables` [n, P] int64: each row's kernel pages from its first on, as far as
    t + 1 and its drafting reach (t's start + 3k; the scheduler's lookahead holds them); `stops` [n, S] int64:
    each row's stop tokens (-1: none), or None when no row has any. A row whose emitted tokens in t hold a stop
    token becomes a padding row (positions 0 .. k on the scratch page, the scratch slot and its k draft rows
    `scratch_drafts`, on the device). `host_lengths`: fill the host lengths and draft slots from the device values
    (a backend that loops on the host; a sync on CUDA), else keep `prev`'s (graph replays read only the device
    tensors). The math is `next_verify_rows`'."""
    n = prev.num_seqs
    rows = next_verify_rows(prev.positions, prev.state_slots, prev.draft_slots, values, tables, stops, k=k,
                            kernel_block_size=kernel_block_size, scratch_slot=scratch_slot, scratch_page=scratch_page,
                            scratch_drafts=scratch_drafts)
    draft_slots = rows["draft_slots"].reshape(-1)
    context_cpu, drafts_cpu = prev.context_lens_cpu, prev.draft_slots_cpu
    if host_lengths:
        context_cpu = tuple(rows["context_lens"].tolist())
        drafts_cpu = tuple(tuple(row) for row in draft_slots.view(n, k).tolist())
    batch = ForwardBatch(
        input_ids=rows["input_ids"].reshape(-1).to(prev.input_ids.dtype),
        positions=rows["positions"].reshape(-1).to(prev.positions.dtype), cu_seqlens=prev.cu_seqlens,
        context_lens=rows["context_lens"].to(prev.context_lens.dtype),
        block_tables=rows["block_tables"].to(prev.block_tables.dtype),
        kv_rows=rows["kv_rows"].reshape(-1).to(prev.kv_rows.dtype),
        state_slots=rows["state_slots"].to(prev.state_slots.dtype), logits_indices=prev.logits_indices,
        query_lens_cpu=prev.query_lens_cpu, context_lens_cpu=context_cpu, draft_rows=prev.draft_rows,
        draft_slots=draft_slots, draft_slots_cpu=drafts_cpu,
    )
    return batch, rows["near"]


STOP_WIDTH = 8  # stop tokens per row that a chained step checks on the device (a row with more is not chained)


class ChainTables:
    """Each row's kernel pages and stop tokens for the chained steps (`next_verify_rows`' `tables` and `stops`), on
    the device and kept from step to step: a row is written again only when its sequence or its blocks changed (a
    row gains a block every block_size / tokens-per-step steps), so a step costs the host a tuple comparison per
    row and, when some row changed, one write of those rows. `rows` x `width` pages (a row's pages past `width`
    are never read: the verify graphs' tables are that wide), `STOP_WIDTH` stop tokens (-1: none)."""

    def __init__(self, rows: int, width: int, *, pages_per_block: int, scratch_page: int,
                 device: torch.device) -> None:
        self.width, self.pages_per_block, self.scratch_page = width, pages_per_block, scratch_page
        self.tables = torch.full((rows, width), scratch_page, dtype=torch.int64, device=device)
        self.stops = torch.full((rows, STOP_WIDTH), -1, dtype=torch.int64, device=device)
        self._blocks: list[tuple[int, tuple[int, ...]] | None] = [None] * rows  # (seq id, block ids) of each row
        self._stops: list[int | None] = [None] * rows  # the seq id whose stop tokens each row holds

    def update(self, chunks: Sequence[ScheduledChunk], stop_tokens) -> None:
        """Make rows 0 .. len(chunks) - 1 hold the chunks' pages (from `block_ids`) and stop tokens
        (`stop_tokens(seq)`: at most `STOP_WIDTH`), writing only the rows that changed."""
        changed, pages, stopped, stops = [], [], [], []
        per_block, width = self.pages_per_block, self.width
        for r, chunk in enumerate(chunks):
            seq_id, blocks = chunk.seq.seq_id, chunk.block_ids
            key = self._blocks[r]
            if key is None or key[0] != seq_id or (key[1] is not blocks and key[1] != blocks):
                self._blocks[r] = (seq_id, blocks)
                row = [b * per_block + j for b in blocks for j in range(per_block)][:width]
                changed.append(r)
                pages.append(row + [self.scratch_page] * (width - len(row)))
            if self._stops[r] != seq_id:
                self._stops[r] = seq_id
                row = sorted(stop_tokens(chunk.seq))
                stopped.append(r)
                stops.append(row + [-1] * (STOP_WIDTH - len(row)))
        device = self.tables.device
        if changed:
            self.tables.index_copy_(0, to_device(changed, device, torch.int64), to_device(pages, device, torch.int64))
        if stopped:
            self.stops.index_copy_(0, to_device(stopped, device, torch.int64), to_device(stops, device, torch.int64))


class ChainGraphs:
    """Async speculative steps with no host work per row: per batch bucket B of the verify and drafting graphs,
    a *prep* graph (t's rollback select, then t + 1's verify inputs written straight into the verify graph's
    static buffers: `next_verify_rows` over all B rows, fed from t's values laid out for B rows, `ChainTables` and
    `pad`, the rows past the step's, which become padding rows) and an *after* graph (the drafting graph's inputs
    from the verify graph's static inputs and outputs: `DraftGraphs.load_after_verify` over all B rows). A chained
    step is then: t's values into the bucket's layout (one scatter), prep replay, verify replay, after replay,
    drafting replay, the drafts into the layout and t + 1's values out of it (one gather each). `verify`: the
    runner's verify `_DecodeGraphs`; `drafting`: its `DraftGraphs`; `state_groups`: the pools' state tensors.
    Without `capture` the same work runs eagerly on the buffers (what the CPU tests check)."""

    def __init__(self, verify, drafting, tables: ChainTables, state_groups: Sequence[torch.Tensor], *, k: int,
                 kernel_block_size: int, draft_base: int, scratch_slot: int, scratch_page: int,
                 scratch_drafts: torch.Tensor) -> None:
        self.verify, self.drafting, self.tables, self.state_groups = verify, drafting, tables, tuple(state_groups)
        self.k, self.kernel_block_size, self.draft_base = k, kernel_block_size, draft_base
        self.scratch_slot, self.scratch_page, self.scratch_drafts = scratch_slot, scratch_page, scratch_drafts
        self.sizes = tuple(size for size in verify.sizes if size in drafting.sizes and size <= tables.tables.shape[0])
        device = tables.tables.device
        per_row = 1 + k + 1 + k
        self.values = {size: torch.zeros(size * per_row, dtype=torch.int64, device=device) for size in self.sizes}
        self.out = {size: torch.zeros(size * per_row, dtype=torch.int64, device=device) for size in self.sizes}
        biggest = max(self.sizes, default=0)
        self.pad = torch.ones(biggest, dtype=torch.bool, device=device)
        self.near = torch.full((biggest, (2 * k - 1) // kernel_block_size + 2), scratch_page, dtype=torch.int64,
                               device=device)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self._live = -1  # the step's row count `pad` holds
        self._layouts: dict[tuple[int, int], torch.Tensor] = {}

    def owns(self, batch: ForwardBatch) -> bool:
        """Whether `batch` is a view of the verify graph's static buffers (`prepare`'s)."""
        return batch.input_ids.data_ptr() == self.verify.input_ids.data_ptr()

    def layout(self, n: int, size: int) -> torch.Tensor:
        """Where each entry of n rows' values (`DeviceVerdicts.values`) lies in the bucket's layout of `size`
        rows (made once per (n, size))."""
        key = (n, size)
        if key not in self._layouts:
            k, q = self.k, 1 + self.k
            index = list(range(n)) + [size + j * size + r for j in range(k) for r in range(n)] + [
                size + k * size + r * q + i for r in range(n) for i in range(q)]
            self._layouts[key] = to_device(index, self.pad.device, torch.int64)
        return self._layouts[key]

    @torch.inference_mode()
    def prepare(self, prev: ForwardBatch, values: torch.Tensor, size: int, *, replay: bool = True) -> tuple[
            ForwardBatch, torch.Tensor]:
        """Queue t's rollback and write t + 1's verify inputs into the verify graph's buffers (`prev`: t's batch,
        n rows, which ran in the verify graph of bucket `size`; `values`: its `DeviceVerdicts.values`); returns
        t + 1's batch (views of those buffers: `ModelRunner.execute` replays it without a load) and its near pages.
        The chain tables must hold t's rows (`ChainTables.update`)."""
        n, k, q = prev.num_seqs, self.k, 1 + self.k
        self.values[size].index_copy_(0, self.layout(n, size), values)
        if self._live != n:
            self._live = n
            self.pad[:n] = False
            self.pad[n:] = True
        self._run("prep", size, replay)
        v = self.verify
        batch = ForwardBatch(
            input_ids=v.input_ids[: n * q], positions=v.positions[: n * q], cu_seqlens=v.cu_seqlens[: n + 1],
            context_lens=v.context_lens[:n], block_tables=v.block_tables[:n], kv_rows=v.kv_rows[: n * q],
            state_slots=v.state_slots[:n], logits_indices=v.logits_indices[:n], query_lens_cpu=(q,) * n,
            context_lens_cpu=prev.context_lens_cpu, draft_rows=v.draft_rows[: n * k],
            draft_slots=v.draft_slots[: n * k], draft_slots_cpu=prev.draft_slots_cpu)
        return batch, self.near[:n]

    @torch.inference_mode()
    def draft(self, n: int, size: int, *, replay: bool = True) -> torch.Tensor:
        """After the verify graph of bucket `size` replayed `prepare`'s batch of n rows: queue the drafting from its
        outputs (after graph, drafting graph); the values of n rows (`DraftGraphs.run_after_verify`'s)."""
        self._run("after", size, replay)
        k = self.k
        out = self.out[size]

        def host_lens():  # (a backend that loops on the host; never with captured graphs)
            first = self.verify.positions[: size * (1 + k)].view(size, 1 + k)[:, 0]
            ends = (first + out[:size] + 1).tolist()
            return (tuple(int(c) for c in self.verify.context_lens[:size].tolist()),
                    [tuple(end + step for end in ends) for step in range(1, k)])

        tokens = self.drafting.replay_or_run(1 + k, size, replay, host_lens)
        out[size: size + k * size].copy_(tokens.reshape(-1))
        return out.index_select(0, self.layout(n, size))

    def _prep(self, size: int) -> None:
        k, q, v = self.k, 1 + self.k, self.verify
        values, slots = self.values[size], v.state_slots[:size]
        source = select_rows(slots, values[:size].clamp(0, k), k=k, draft_base=self.draft_base)
        copy_state_rows(self.state_groups, source, slots)
        rows = next_verify_rows(v.positions[: size * q], slots, v.draft_slots[: size * k], values,
                                self.tables.tables[:size], self.tables.stops[:size], self.pad[:size], k=k,
                                kernel_block_size=self.kernel_block_size, scratch_slot=self.scratch_slot,
                                scratch_page=self.scratch_page, scratch_drafts=self.scratch_drafts)
        width = self.tables.width
        v.input_ids[: size * q].copy_(rows["input_ids"].reshape(-1))
        v.positions[: size * q].copy_(rows["positions"].reshape(-1))
        v.kv_rows[: size * q].copy_(rows["kv_rows"].reshape(-1))
        v.state_slots[:size].copy_(rows["state_slots"])
        v.context_lens[:size].copy_(rows["context_lens"])
        v.block_tables[:size, :width].copy_(rows["block_tables"])
        v.draft_slots[: size * k].copy_(rows["draft_slots"].reshape(-1))
        self.near[:size].copy_(rows["near"])

    def _after(self, size: int) -> None:
        k, q, v = self.k, 1 + self.k, self.verify
        accepted, target, _ = self.drafting.load_after_verify(
            v.input_ids[: size * q], v.positions[: size * q], v.kv_rows[: size * q], v.state_slots[:size],
            v.context_lens[:size], v.block_tables[:size], v.outputs[size], v.hidden[size], self.near[:size], size)
        out = self.out[size]
        out[:size].copy_(accepted)
        out[size + k * size:].copy_(target.reshape(-1))

    def _run(self, kind: str, size: int, replay: bool) -> None:
        graph = self.graphs.get((kind, size)) if replay else None
        if graph is not None:
            graph.replay()
        elif kind == "prep":
            self._prep(size)
        else:
            self._after(size)

    def capture(self, pool=None) -> None:
        """Capture the prep and after graph of every bucket (in `pool`, the verify graphs' memory pool), each run
        once eagerly first on the buffers as they are at start-up (every row padding: only the scratch slot's
        state is written)."""
        device = self.pad.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for size in self.sizes:
                self._prep(size)
                self._after(size)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        with torch.inference_mode():
            for size in reversed(self.sizes):
                for kind, work in (("prep", self._prep), ("after", self._after)):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        work(size)
                    pool = graph.pool()
                    self.graphs[kind, size] = graph
        torch.cuda.synchronize(device)

    def reset(self) -> None:
        """Destroy the captured graphs (later steps run the same work eagerly on the buffers)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
