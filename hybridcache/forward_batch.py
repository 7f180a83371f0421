"""The one object that carries a forward step, and the device pools the model reads and writes.

This module is the contract between the engine (which builds a `ForwardBatch` and owns the pools) and
the models (which only read the batch and update the pools in place). It imports only torch.

Worked example (block_size B=16, kernel_block_size 8, so 2 kernel pages per scheduler block)::

    seq 0: 20 tokens already in the cache, 5 new prefill tokens   -> query_len 5, context_len 25
    seq 1: 40 tokens already in the cache, 1 decode token          -> query_len 1, context_len 41

    input_ids      [t0 t1 t2 t3 t4 | d0]                 T = 6 tokens
    positions      [20 21 22 23 24 | 40]
    cu_seqlens     [0, 5, 6]
    context_lens   [25, 41]
    block_tables   seq 0 owns scheduler blocks [3, 7]   -> kernel pages [6, 7, 14, 15]
                   seq 1 owns scheduler blocks [1, 2, 5] -> kernel pages [2, 3, 4, 5, 10, 11]
                   padded with 0 to the longest row
    slot_mapping   the token at position p goes to flat KV row pages[p // 8] * 8 + p % 8:
                   seq 0: p=20..23 -> page 14, rows 116..119; p=24 -> page 15, row 120
                   seq 1: p=40 -> page 11, row 88
    state_slots    [slot of seq 0, slot of seq 1]
    logits_indices [4, 5]           (the last token of each sequence)

A sequence with `context_len == query_len` starts from step 0: its recurrent and conv states start at
zero whatever its slot holds. Otherwise its states are read from `state_slots` and written back there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.cache.plan import CopyKind


@dataclass(frozen=True)
class LayerShapes:
    """Shapes of the per-layer cache tensors a model needs; the engine allocates pools from it.

    `conv_width` is the number of past pre-convolution inputs kept per channel: conv kernel size - 1.
    """

    num_attention_layers: int
    num_kv_heads: int
    head_dim: int
    num_linear_layers: int
    conv_dim: int
    conv_width: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int


@dataclass
class DevicePools:
    """The device memory the cache manages; every tensor is updated in place by the forward.

    kv   : [num_attention_layers, 2, num_pages, kernel_block_size, num_kv_heads, head_dim]
           (index 0 of dim 1 = keys after q/k-norm and RoPE, 1 = values), model dtype
    conv : [num_linear_layers, num_slots, conv_dim, conv_width], model dtype
    ssm  : [num_linear_layers, num_slots, num_v_heads, k_head_dim, v_head_dim], fp32 by default
    """

    kv: torch.Tensor
    conv: torch.Tensor
    ssm: torch.Tensor

    @property
    def kernel_block_size(self) -> int:
        return self.kv.shape[3]

    @classmethod
    def allocate(
        cls,
        shapes: LayerShapes,
        *,
        num_pages: int,
        kernel_block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        state_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> DevicePools:
        kv = torch.zeros(
            shapes.num_attention_layers, 2, num_pages, kernel_block_size, shapes.num_kv_heads,
            shapes.head_dim, dtype=dtype, device=device,
        )
        conv = torch.zeros(
            shapes.num_linear_layers, num_slots, shapes.conv_dim, shapes.conv_width, dtype=dtype,
            device=device,
        )
        ssm = torch.zeros(
            shapes.num_linear_layers, num_slots, shapes.num_v_heads, shapes.k_head_dim,
            shapes.v_head_dim, dtype=state_dtype, device=device,
        )
        return cls(kv=kv, conv=conv, ssm=ssm)


@dataclass(frozen=True)
class DeviceCopyOp:
    """One `hybridcache.cache.CopyOp` as device id tensors: src_ids, dst_ids [N] int64. KV ids are scheduler
    blocks; state ids are slots. The runner executes the ops in order, on the forward's stream: those whose
    `kind.phase` is BEFORE_FORWARD, then the forward, then the others."""

    kind: CopyKind
    src_ids: torch.Tensor
    dst_ids: torch.Tensor


@dataclass(frozen=True)
class ForwardBatch:
    """Everything one forward step needs, already on the model's device (see the module docstring).

    input_ids      [T] int64      tokens of all sequences, concatenated in sequence order
    positions      [T] int64      absolute position of each token in its sequence
    cu_seqlens     [S + 1] int32  query token offsets: sequence i owns rows cu_seqlens[i]:cu_seqlens[i+1]
    context_lens   [S] int32      tokens in the KV cache of each sequence after this step (history + new)
    block_tables   [S, P] int32   kernel page ids of each sequence, in order, padded with 0
    slot_mapping   [T] int64      flat row (page * kernel_block_size + offset) where each token's KV goes
    state_slots    [S] int64      state pool row of each sequence
    logits_indices [S] int64      row of each sequence's last token (where logits are computed)
    query_lens_cpu / context_lens_cpu: the same lengths as host tuples, for per-sequence loops.
    copies         the step's copy ops, executed by the runner around the forward (the model never reads them).
    embed_rows [M] int64 / embeds [M, hidden]: rows of the step whose input embedding is given (multimodal
                   spans) instead of looked up from input_ids; None when there are none.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    state_slots: torch.Tensor
    logits_indices: torch.Tensor
    query_lens_cpu: tuple[int, ...]
    context_lens_cpu: tuple[int, ...]
    copies: tuple[DeviceCopyOp, ...] = ()
    embed_rows: torch.Tensor | None = None
    embeds: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)
