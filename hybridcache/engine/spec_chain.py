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
    tensors)."""
    n, q, kbs = prev.num_seqs, 1 + k, kernel_block_size
    device = values.device
    accepted = values[:n]
    drafts = values[n: n + k * n].view(k, n).t()
    target = values[n + k * n: n + k * n + n * q].view(n, q)
    within = torch.arange(q, device=device)
    positions = prev.positions.view(n, q)[:, :1] + accepted[:, None] + 1 + within[None, :]
    input_ids = torch.cat([target.gather(1, accepted[:, None]), drafts], dim=1)
    state_slots, draft_slots = prev.state_slots, prev.draft_slots.view(n, k)
    if stops is not None:  # rows that stop in t: padding rows
        emitted = within[None, :] <= accepted[:, None]
        done = (((target[:, :, None] == stops[:, None, :]).any(dim=-1) & emitted).any(dim=1))[:, None]
        positions = torch.where(done, within[None, :], positions)
        tables = torch.where(done, torch.full_like(tables, scratch_page), tables)
        input_ids = torch.where(done, 0, input_ids)
        state_slots = torch.where(done[:, 0], scratch_slot, state_slots)
        draft_slots = torch.where(done, scratch_drafts[None, :], draft_slots)
    draft_slots = draft_slots.reshape(-1)
    kv_rows = tables.gather(1, positions // kbs) * kbs + positions % kbs
    context_lens = positions[:, -1] + 1
    width = (2 * k - 1) // kbs + 2
    columns = (positions[:, :1] // kbs + torch.arange(width, device=device)[None, :]).clamp(max=tables.shape[1] - 1)
    near = tables.gather(1, columns)
    context_cpu, drafts_cpu = prev.context_lens_cpu, prev.draft_slots_cpu
    if host_lengths:
        context_cpu = tuple(context_lens.tolist())
        drafts_cpu = tuple(tuple(row) for row in draft_slots.view(n, k).tolist())
    batch = ForwardBatch(
        input_ids=input_ids.reshape(-1).to(prev.input_ids.dtype), positions=positions.reshape(-1).to(
            prev.positions.dtype), cu_seqlens=prev.cu_seqlens, context_lens=context_lens.to(prev.context_lens.dtype),
        block_tables=tables.to(prev.block_tables.dtype), kv_rows=kv_rows.reshape(-1).to(prev.kv_rows.dtype),
        state_slots=state_slots.to(prev.state_slots.dtype), logits_indices=prev.logits_indices,
        query_lens_cpu=prev.query_lens_cpu, context_lens_cpu=context_cpu, draft_rows=prev.draft_rows,
        draft_slots=draft_slots, draft_slots_cpu=drafts_cpu,
    )
    return batch, near
