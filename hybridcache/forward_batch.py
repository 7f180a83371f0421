"""The one object that carries a forward step.

This module is the contract between the engine (which builds a `ForwardBatch`), the kernel backend (whose
`prepare` attaches its step metadata) and the models (which only read the batch and update the pools of
`hybridcache.state_spec` in place). It imports only torch and the pure-Python leaf `hybridcache.copy_kinds`.

Worked example (block_size B=16, kernel_block_size 8, so 2 kernel pages per scheduler block)::

    seq 0: 20 tokens already in the cache, 5 new prefill tokens   -> query_len 5, context_len 25
    seq 1: 40 tokens already in the cache, 1 decode token          -> query_len 1, context_len 41

    input_ids      [t0 t1 t2 t3 t4 | d0]                 T = 6 tokens
    positions      [20 21 22 23 24 | 40]
    cu_seqlens     [0, 5, 6]
    context_lens   [25, 41]
    block_tables   seq 0 owns scheduler blocks [3, 7]   -> kernel pages [6, 7, 14, 15]
                   seq 1 owns scheduler blocks [1, 2, 5] -> kernel pages [2, 3, 4, 5, 10, 11]
                   padded with 0 to the longest row, rounded up to 16 columns
    kv_rows        the token at position p goes to flat KV row pages[p // 8] * 8 + p % 8:
                   seq 0: p=20..23 -> page 14, rows 116..119; p=24 -> page 15, row 120
                   seq 1: p=40 -> page 11, row 88
    state_slots    [slot of seq 0, slot of seq 1]
    logits_indices [4, 5]           (the last token of each sequence)

A sequence with `context_len == query_len` starts from step 0: its recurrent and conv states start at
zero whatever its slot holds. Otherwise its states are read from `state_slots` and written back there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridcache.copy_kinds import CopyKind, Pool


@dataclass(frozen=True)
class DeviceCopyOp:
    """One `hybridcache.cache.CopyOp` as device id tensors: src_ids, dst_ids [N] int64. KV ids are scheduler
    blocks; state ids are runtime chunks (`slot * k + j`, j < k) and pages (blocks of the pool that hold a
    checkpoint's state; `hybridcache.cache.plan`). The runner executes the ops in order, on the forward's
    stream: those whose `kind.phase` is BEFORE_FORWARD, then the forward, then the others. A host-tier op
    (`Pool.HOST`) also keeps its host block ids on the host, `host_ids` (its destinations, or a HOST_LOAD's
    sources), which the host-side copies index with; () for every other op."""

    kind: CopyKind
    src_ids: torch.Tensor
    dst_ids: torch.Tensor
    host_ids: tuple[int, ...] = ()

    @staticmethod
    def host_side(kind: CopyKind, src_ids: tuple[int, ...], dst_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The host block ids of an op of `kind` with these ids (see the class docstring)."""
        if kind.pool is not Pool.HOST:
            return ()
        return src_ids if kind is CopyKind.HOST_LOAD else dst_ids


@dataclass(frozen=True)
class ForwardBatch:
    """Everything one forward step needs, already on the model's device (see the module docstring).

    input_ids      [T] int64      tokens of all sequences, concatenated in sequence order
    positions      [T] int64      absolute position of each token in its sequence
    cu_seqlens     [S + 1] int32  query token offsets: sequence i owns rows cu_seqlens[i]:cu_seqlens[i+1]
    context_lens   [S] int32      tokens in the KV cache of each sequence after this step (history + new)
    block_tables   [S, P] int32   kernel page ids of each sequence, in order, padded with 0 (P a multiple of 16)
    kv_rows        [T] int64      flat row (page * kernel_block_size + offset) where each token's KV goes
    state_slots    [S] int64      state pool row of each sequence
    logits_indices [S] int64      row of each sequence's last token (where logits are computed)
    rope_positions [3, T] int64   M-RoPE (temporal, height, width) rotary position of each token, when a chunk of
                   the step overlaps an image span or follows one (`hybridcache.multimodal.rope_positions`); None
                   when every token's rotary position is `positions` on the three axes. Text rows are equal on the
                   three axes (their index moved by the images before them); decode rows are text.
    prompt_logits_rows [R] int64  more rows whose logits the forward returns, after the S rows of logits_indices
                   (prompt logprobs: every row of a prompt chunk but its last); None when there are none.
    query_lens_cpu / context_lens_cpu: the same lengths as host tuples, for per-sequence loops.
    copies         the step's copy ops, executed by the runner around the forward (the model never reads them).
    embed_rows [M] int64 / embeds [M, hidden]: rows of the step whose input embedding is given (multimodal
                   spans) instead of looked up from input_ids; None when there are none.
    draft_rows [M] int64 / draft_slots [M] int64: speculative decoding: the rows of each verify row's first n
                   positions (its last token and all drafts but the last), and the state pool row where the
                   recurrent state (and `last_hidden`) after each is kept; the forward returns their logits after
                   the prompt rows. None when the step verifies nothing. `draft_slots_cpu`: per sequence, the same
                   pool rows on the host (() for a sequence that verifies nothing), for per-sequence loops.
    metadata       what the kernel backend's `prepare` derived from the batch for this step (decode rows,
                   fresh-sequence masks, host copies, kernel plans); None until prepared. Only the backend
                   that attached it reads it.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    kv_rows: torch.Tensor
    state_slots: torch.Tensor
    logits_indices: torch.Tensor
    query_lens_cpu: tuple[int, ...]
    context_lens_cpu: tuple[int, ...]
    copies: tuple[DeviceCopyOp, ...] = ()
    embed_rows: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    rope_positions: torch.Tensor | None = None
    prompt_logits_rows: torch.Tensor | None = None
    draft_rows: torch.Tensor | None = None
    draft_slots: torch.Tensor | None = None
    draft_slots_cpu: tuple[tuple[int, ...], ...] = ()
    metadata: Any = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)


TABLE_WIDTH_ALIGN = 16


def table_width(num_pages: int) -> int:
    """Columns of a block table whose longest row has `num_pages` pages (the step's, `engine/input_builder.py`, or
    a kernel's own, as MLA's scratch pool's): rounded up to a multiple of 16, so the table's row stride always
    takes Triton's same integer specialisation (divisible by 16). Unpadded, a batch whose rows all fit one page
    has stride 1, a constant Triton compiles a kernel variant for, inside a request (what that cost:
    docs/bench.md, "Start-up compiles")."""
    return -(-num_pages // TABLE_WIDTH_ALIGN) * TABLE_WIDTH_ALIGN
