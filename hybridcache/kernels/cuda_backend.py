"""The CUDA kernel backend: the `KernelBackend` ops on the Triton / flash-linear-attention / grouped-GEMM kernels.

| op               | all-decode step (every query_len == 1)      | any other step                                  |
| ---------------- | ------------------------------------------- | ----------------------------------------------- |
| write_kv, attention | its attention backend (default "triton", `attention/triton_backend.py`: split-KV decode   |
|                  | kernel for an all-decode step, the paged flash-attention prefill kernel otherwise)            |
| mla_attention    | Kimi Linear's MLA: decode absorbed, one Triton launch over rows of (token, head)         |
|                  | (`attention/triton_latent.py`); prefill expanded into the paged prefill kernel, in windows of |
|                  | keys past 32,768 context tokens, its leading decode rows absorbed (`mla_prefill`)              |
| causal_conv1d    | in-place step kernel                        | varlen kernel + state write                     |
| gated_delta_rule | in-place Triton step kernel                 | our l2norm of q / k, then fla's chunked kernel  |
|   per-channel g (Kimi Delta Attention) | the same step kernel, g a column | fla's chunked KDA kernels, leading |
|                  | of per-row decays                           | decode rows in the step kernel; verify rows: torch |
| verify rows (speculative decoding: a last token and n drafts) | steps of decode and verify rows only: the fused |
|                  | recurrent verify kernel for all of them (`gated_delta/triton_verify.py`: outputs, the state after |
|                  | each draft position into its draft row, the final state into the slot); with prefill chunks: the |
|                  | same kernel writes only the draft states, then fla runs every sequence. Conv: the draft conv      |
|                  | states (`conv/triton_verify.py`) before the varlen kernel                                       |
| moe              | Triton expert GEMM (few rows per expert) or `torch._grouped_mm` (`moe/grouped.py`); the combine |
|                  | of the routed rows adds the shared expert's sigmoid(gate) * shared in the same launch; FP8    |
|                  | experts: `gemm/triton_fp8_moe.py`, the shared expert as one more expert where it fits; on fp32 x |
|                  | W8A16, the exact path (`triton_fp8_moe.fp8_exact`)                                             |
| rms_norm, gated_rms_norm, add_rms_norm | fused Triton kernels, 2,048 // width rows per program (`norm/triton.py`) |
| delta_gates      | one Triton launch for g and beta (`gated_delta/triton_gates.py`)                               |
| gated_delta      | the gates and the rule: all-decode, the step kernel makes the gates from a, b itself (the code |
|                  | of delta_gates); else delta_gates, then gated_delta_rule                                       |
| route            | one Triton launch: softmax, top-k, renormalisation (`moe/triton_route.py`)                     |
| route_sigmoid    | one group: the same launch with sigmoid scores ranked with the bias; groups: the torch reference |
| ssd_scan (Mamba2) | one Triton launch (`mamba2/triton_step.py`) | fla's chunked simple-GLA kernels (`mamba2/fla.py`),|
|                  | leading decode rows in the step launch; verify rows: the torch reference per sequence          |
| gated_group_rms_norm | one Triton launch (Mamba2's gated norm: `norm/triton.py`)                                  |
| selective_scan (Mamba1) | the Triton scan (`mamba1/triton.py`): one launch for every sequence, a program per        |
|                  | (sequence, channel block) walking its tokens; verify rows: the torch reference per sequence    |
| rotary           | one Triton launch per tensor: partial rotate-half RoPE (`rotary/triton.py`)                    |
| norm_rotary      | one Triton launch: the attention layer's q_norm, k_norm and RoPE of both (`rotary/triton.py`)  |
| sigmoid_mul      | one Triton launch: the attention output gate, reading the strided gate in place (`activation/`)|
| silu_mul         | one Triton launch each: the MLP's silu(gate) * up and the MoE block's routed + sigmoid(gate) * |
| sigmoid_gate_add | shared (`activation/triton.py`)                                                                |
| relu_square      | one Triton launch: the ungated relu^2 MLP's hidden activation (`activation/triton.py`)         |

`prepare` reads only host values the batch carries (`query_lens_cpu`, `context_lens_cpu`) and attaches
`CudaMetadata`: whether the step is all-decode, the longest context, int64 cu_seqlens for fla, the (sequence,
block) tables of the varlen kernels, built on the device, and its attention backend's metadata. No op
synchronises with the host (bf16; fp32 MoE goes through torch's grouped-GEMM fallback, which does). This module
imports Triton; fla is imported on first use inside `gated_delta/fla.py` and `mamba2/fla.py`. `get_backend` picks
this backend for CUDA devices when both are installed (`pip install 'hybridcache-llm[cuda]'`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridcache.forward_batch import ForwardBatch
from hybridcache.kernels import streams
from hybridcache.kernels.activation import triton as triton_activation
from hybridcache.kernels.attention import latent, mla_prefill, triton_latent, triton_paged
from hybridcache.kernels.attention.base import AttentionBackend
from hybridcache.kernels.backend import SharedOps, add_shared, mamba1_scan, mamba2_scan, per_channel_delta_scan
from hybridcache.kernels.conv.triton import causal_conv1d_decode, causal_conv1d_varlen
from hybridcache.kernels.conv.triton_verify import conv_draft_states
from hybridcache.kernels.gated_delta import fla as delta_fla
from hybridcache.kernels.gated_delta import triton_gates
from hybridcache.kernels.gated_delta.fla import (
    CHUNK_SIZE,
    LeadingDecodes,
    chunk_gated_delta_rule_varlen,
    leading_decodes,
    mixed_gated_delta_rule,
)
from hybridcache.kernels.gated_delta.triton_step import gated_delta_rule_decode
from hybridcache.kernels.gated_delta.triton_verify import gated_delta_rule_verify
from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, fp8_exact, fp8_grouped_experts, shared_fits
from hybridcache.kernels.gemm.triton_fp8_moe import compile_tiles as compile_fp8_tiles
from hybridcache.kernels.mamba1 import triton as mamba1_triton
from hybridcache.kernels.mamba2 import fla as mamba2_fla
from hybridcache.kernels.mamba2 import reference as mamba2_ref
from hybridcache.kernels.mamba2 import triton_step as mamba2_step
from hybridcache.kernels.moe import reference as moe_ref
from hybridcache.kernels.moe import triton_route
from hybridcache.kernels.moe.grouped import ExpertWeights, compile_tiles, grouped_experts
from hybridcache.kernels.norm import triton as fused_norm
from hybridcache.kernels.rotary import triton as triton_rotary
from hybridcache.kernels.shapes import ModelShapes, check_cuda_model
from hybridcache.kernels.streams import Pending
from hybridcache.kernels.varlen import any_fresh, chunk_indices, fresh_mask

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyRows:
    """The verify rows of a speculative decoding step (`ForwardBatch.draft_slots_cpu`), for the verify kernels.

    short        every sequence is a decode or verify row (query_len == 1 + its drafts): the fused recurrent
                 kernel runs them all; else prefill chunks are present and fla runs every sequence after it
    draft_table  [S, k] int64 the pool row of the state after each draft position (unused entries 0)
    num_drafts   [S] int32 the drafts of each sequence (0: no verify row)
    """

    short: bool
    draft_table: torch.Tensor
    num_drafts: torch.Tensor

    @staticmethod
    def of(batch: ForwardBatch) -> VerifyRows | None:
        """None when the batch verifies nothing. When every sequence has the same number of drafts (what the verify
        graphs capture), the table is a view of `batch.draft_slots` on the device; else it is built from the host
        lists and copied without a host sync."""
        drafts = batch.draft_slots_cpu
        if not any(drafts):
            return None
        short = all(length == 1 + len(d) for length, d in zip(batch.query_lens_cpu, drafts, strict=True))
        width = max(len(d) for d in drafts)
        if all(len(d) == width for d in drafts):
            num_drafts = torch.full((len(drafts),), width, dtype=torch.int32, device=batch.draft_slots.device)
            return VerifyRows(short, batch.draft_slots.view(len(drafts), width), num_drafts)
        table = [list(d) + [0] * (width - len(d)) for d in drafts]
        device = batch.input_ids.device
        host = torch.tensor([row + [len(d)] for row, d in zip(table, drafts, strict=True)], dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
        packed = host.to(device, non_blocking=True)
        return VerifyRows(short, packed[:, :width], packed[:, width].to(torch.int32))


@dataclass(frozen=True)
class CudaMetadata:
    """What `CudaBackend.prepare` derives once per step.

    all_decode       every sequence feeds one token (decode kernels), from the host lengths
    max_context_len  the longest context_len (sizes the split-KV decode grid)
    cu_seqlens       batch.cu_seqlens as int64 (flash-linear-attention's index type)
    chunks           [NT, 2] int64 (sequence, block of 64 rows) for the conv and gated delta prefill kernels, or
                     None in an all-decode step
    attention        what the attention backend's `prepare` returned
    verify           the step's verify rows (speculative decoding), or None
    fresh            [S] bool: the sequences that start at step 0 (`varlen.fresh_mask`; every DeltaNet layer's
                     prefill reads it), or None in an all-decode step or one with no fresh sequence
                     (`varlen.any_fresh`: the layers then need no mask)
    lead             a mixed step's leading decode rows, which the DeltaNet layers run in the step kernel
                     (`fla.LeadingDecodes`), or None (no such run, or a verify step)
    host_lengths     whether the batch's host lengths are the step's own (False: a whole-step graph's static batch,
                     `prefill_graphs.SequenceGraphs`, whose device lengths alone are the step's, replayed or run
                     eagerly); ops that read host lengths (MLA's expanded prefill) run otherwise there
    """

    all_decode: bool
    max_context_len: int
    cu_seqlens: torch.Tensor
    chunks: torch.Tensor | None
    attention: Any
    verify: VerifyRows | None = None
    fresh: torch.Tensor | None = None
    lead: LeadingDecodes | None = None
    host_lengths: bool = True


def _metadata(batch: ForwardBatch) -> CudaMetadata:
    if not isinstance(batch.metadata, CudaMetadata):
        raise ValueError("the batch was not prepared by CudaBackend.prepare")
    return batch.metadata


def keep_autotuning() -> None:
    """Have Triton keep autotuning results in its cache folder (`TRITON_CACHE_AUTOTUNING=1`, unless the environment
    names a value), so that a restart with the folder kept loads fla's tuned configs instead of timing every
    candidate again (fla's KDA kernels time theirs for minutes at Kimi's widths). Triton reads the setting when an
    autotuned kernel is defined, so this runs before the backend's first fla import; the cached entry is keyed by
    the kernel, its candidates, the tuning key and the GPU target."""
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")


class CudaBackend(SharedOps):
    """`KernelBackend` on CUDA (see the module docstring). Holds, per sparse MoE block, its experts' weights
    stacked for the grouped GEMM (the experts' parameters are re-pointed at the stack: one copy in memory)."""

    supports_verify_states = True  # speculative decoding's verify rows (`VerifyRows`, the verify kernels)

    def __init__(self, attention_backend: AttentionBackend, *, kda_kernels: bool = True) -> None:
        """`kda_kernels`: a per-channel gated delta rule (Kimi Delta Attention) on fla's KDA kernels and the step
        kernel (`gated_delta_rule`); False keeps it on the torch reference (`per_channel_delta_scan`)."""
        self.attention_backend = attention_backend
        self.kda_kernels = kda_kernels
        # fla's autotuned kernels keep their timings in the Triton cache (`keep_autotuning`)
        keep_autotuning()
        self._experts: weakref.WeakKeyDictionary[nn.Module, ExpertWeights | Fp8ExpertWeights] = (
            weakref.WeakKeyDictionary()
        )
        self._said_scan = False  # the one log line of the first Mamba2 scan
        self._said_selective_scan = False  # and of the first Mamba1 scan
        self._said_kda = False  # and of the first Kimi Delta Attention rule

    def check_model(self, shapes: ModelShapes) -> None:
        """UnsupportedModelError naming every reason this backend's kernels (and its attention backend's)
        cannot run a model of these shapes (`kernels.shapes.check_cuda_model`)."""
        check_cuda_model(shapes, self.attention_backend)

    def workspace_bytes(self, shapes: ModelShapes, num_tokens: int, dtype: torch.dtype) -> int:
        """MLA's expanded prefill at its cap (`mla_prefill.workspace_bytes`: its scratch, one up-projection, the
        padded queries and the fp32 sums), which a fresh profiling forward never reaches; 0 without MLA layers."""
        m = shapes.mla
        if m is None:
            return 0
        return mla_prefill.workspace_bytes(m.num_heads, m.nope_head_dim, m.shared_head_dim, m.value_head_dim,
                                           m.latent_rank, num_tokens, dtype)

    def supports_cuda_graphs(self, dtype: torch.dtype) -> bool:
        """Whether an all-decode step in `dtype` can be captured in a CUDA graph (no host sync, no host-sized
        work beyond `max_context_len`, which the runner fixes at capture): bf16 only, since the fp32/fp16 MoE
        fallback of `torch._grouped_mm` reads its offsets on the host; and only with a graph-safe attention
        backend."""
        return dtype == torch.bfloat16 and self.attention_backend.graph_safe

    @property
    def masks_padding_rows(self) -> bool:
        """Whether a one-sequence step may run on more rows than its query length (`prefill_graphs.SequenceGraphs`):
        the conv, fla and a graph-safe attention backend's kernels read each sequence's length from cu_seqlens on
        the device and leave the rows past it unwritten. Not with `kda_kernels=False`: the torch reference of the
        per-channel rule (`per_channel_delta_scan`) reads the host's lengths, which such a step's are not."""
        return self.attention_backend.graph_safe and self.kda_kernels

    def prepare(self, batch: ForwardBatch) -> ForwardBatch:
        all_decode = all(length == 1 for length in batch.query_lens_cpu)
        cu_seqlens = batch.cu_seqlens.long()
        chunks = fresh = None
        if not all_decode:
            chunks = chunk_indices(cu_seqlens, batch.query_lens_cpu, CHUNK_SIZE)
            if any_fresh(batch.context_lens_cpu, batch.query_lens_cpu):
                fresh = fresh_mask(cu_seqlens, batch.context_lens)
        verify = None if all_decode else VerifyRows.of(batch)
        lead = None
        if not all_decode and verify is None:
            lead = leading_decodes(cu_seqlens, batch.context_lens, batch.state_slots, batch.query_lens_cpu)
        metadata = CudaMetadata(
            all_decode=all_decode,
            max_context_len=max(batch.context_lens_cpu, default=0),
            cu_seqlens=cu_seqlens,
            chunks=chunks,
            attention=self.attention_backend.prepare(batch),
            verify=verify,
            fresh=fresh,
            lead=lead,
        )
        return dataclasses.replace(batch, metadata=metadata)

    def mla_attention(
        self, q_nope: torch.Tensor, q_shared: torch.Tensor, rows: torch.Tensor, w_uk: torch.Tensor,
        w_uv: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch, *, scale: float,
    ) -> torch.Tensor:
        """A prefill step runs as `mla_prefill.plan` says: its leading decode rows absorbed (`triton_latent.py`,
        which reads the device lengths), the rest expanded (the paged prefill kernel over a scratch pool of the
        contexts' keys and values, sized from the host lengths; in windows of key positions when they exceed
        `mla_prefill.EXPAND_MAX_TOKENS`). Decode steps, captured graphs and a whole-step graph's static batch
        (`CudaMetadata.host_lengths`) run absorbed whole."""
        self.write_kv(kv_layer, *latent.split_rows(rows), batch)
        lens, contexts, metadata = batch.query_lens_cpu, batch.context_lens_cpu, self.step_metadata(batch)
        expandable = metadata.host_lengths and not metadata.all_decode
        plan = mla_prefill.plan(lens, contexts, kv_layer.shape[2]) if expandable else None
        if plan is None:
            return self._mla_absorbed(q_nope, q_shared, w_uk, w_uv, kv_layer, batch.block_tables, batch.cu_seqlens,
                                      batch.context_lens, lens, metadata.max_context_len, scale)
        lead = plan.lead  # decode rows: one token each
        tables, cu, ctx = batch.block_tables, batch.cu_seqlens, batch.context_lens
        if lead:  # (new tensors, not offset views: a kernel argument's pointer alignment is a compile-time choice)
            tables, cu, ctx = tables[lead:], cu[lead:] - lead, ctx[lead:].clone()
        expanded = self._mla_expanded(q_nope[lead:], q_shared[lead:], w_uk, w_uv, kv_layer, tables, cu, ctx,
                                      lens[lead:], contexts[lead:], plan.window, scale)
        if not lead:
            return expanded
        absorbed = self._mla_absorbed(q_nope[:lead], q_shared[:lead], w_uk, w_uv, kv_layer, batch.block_tables[:lead],
                                      batch.cu_seqlens[: lead + 1], batch.context_lens[:lead], lens[:lead],
                                      max(contexts[:lead]), scale)
        return torch.cat([absorbed, expanded])

    @staticmethod
    def _mla_absorbed(
        q_nope: torch.Tensor, q_shared: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, kv_layer: torch.Tensor,
        tables: torch.Tensor, cu: torch.Tensor, ctx: torch.Tensor, lens: Sequence[int], max_context_len: int,
        scale: float,
    ) -> torch.Tensor:
        """MLA absorbed (the latent kernel) for sequences of these block tables, cu_seqlens and device lengths."""
        def attend(absorbed: torch.Tensor) -> torch.Tensor:
            return triton_latent.latent_attention(absorbed, kv_layer, tables, cu, ctx, lens, max_context_len,
                                                  scale=scale, value_dim=w_uk.shape[-1])

        return latent.absorbed_attention(q_nope, q_shared, w_uk, w_uv, attend)

    @staticmethod
    def _mla_expanded(
        q_nope: torch.Tensor, q_shared: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, kv_layer: torch.Tensor,
        tables: torch.Tensor, cu: torch.Tensor, ctx: torch.Tensor, lens: Sequence[int], contexts: Sequence[int],
        window: int | None, scale: float,
    ) -> torch.Tensor:
        """MLA expanded (`mla_prefill`): one pass over the contexts (window None) or windows of `window` keys."""
        width = mla_prefill.scratch_width(w_uk.shape[1], q_shared.shape[-1], w_uv.shape[1])
        dtype = q_nope.dtype
        config = triton_paged.default_prefill_config(width, dtype)
        blocks = sum(-(-n // config.block_m) for n in lens)
        sms = triton_paged.num_sms(q_nope.device)
        if window is None:
            pool, table = mla_prefill.expand_context(kv_layer, w_uk, w_uv, tables, contexts, q_shared.shape[-1])
            query = mla_prefill.padded_query(q_nope, q_shared, width)
            splits = triton_paged.prefill_splits(blocks * query.shape[1], max(contexts), sms)
            out = triton_paged.paged_prefill_attention(query, pool, table, cu, ctx, lens, scale=scale,
                                                       config=config, num_splits=splits)
            return out[..., : w_uv.shape[1]]
        splits = triton_paged.prefill_splits(blocks * q_nope.shape[1], window, sms)

        def partials(query, pool, table, key_window):
            return triton_paged.paged_prefill_partials(query, pool, table, cu, ctx, lens, scale=scale,
                                                       key_window=key_window, num_splits=splits, config=config)

        return mla_prefill.windowed_attention(q_nope, q_shared, kv_layer, w_uk, w_uv, tables, contexts, window,
                                              partials)

    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_layer: torch.Tensor,
        batch: ForwardBatch,
        *,
        activation: str | None = "silu",
        gates: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """All-decode: one launch, the gates inside it; otherwise the gates are torch products around the
        varlen kernels (prefill is bandwidth-bound, not launch-bound)."""
        meta = _metadata(batch)
        if meta.all_decode:
            return causal_conv1d_decode(x, weight, bias, conv_layer, batch.state_slots, batch.context_lens,
                                        activation=activation, gates=gates)
        if gates is not None:
            x = gates[0] * x
        if meta.verify is not None:  # before the varlen kernel rewrites the slots it reads
            conv_draft_states(x, conv_layer, batch.state_slots, batch.cu_seqlens, batch.context_lens,
                              meta.verify.draft_table, meta.verify.num_drafts)
        out = causal_conv1d_varlen(
            x, weight, bias, conv_layer, batch.state_slots, batch.cu_seqlens, batch.context_lens,
            batch.query_lens_cpu, chunk_indices=meta.chunks, activation=activation,
        )
        return out if gates is None else gates[1] * out

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        ssm_layer: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """A per-head g [T, Hv]: the step kernel (all-decode), the verify kernel, fla's chunked gated delta rule.
        A per-channel g [T, Hv, Dk] (Kimi Delta Attention): the step kernel with its per-channel decay (all-decode),
        fla's chunked KDA kernels otherwise, a mixed step's leading decode rows in the step kernel
        (`fla.mixed_gated_delta_rule`); verify rows, CPU tensors and `kda_kernels=False` take the torch reference
        (`per_channel_delta_scan`)."""
        meta = _metadata(batch)
        if g.dim() == 3:
            kernels = self.kda_kernels and meta.verify is None and delta_fla.runs_on(q)
            if not self._said_kda:
                self._said_kda = True
                _logger.info("Kimi Delta Attention layers run fla's chunked KDA kernels for prefill and the step "
                             "kernel for decode rows" if kernels else "Kimi Delta Attention layers run the torch "
                             "reference of the per-channel gated delta rule")
            if not kernels:
                return per_channel_delta_scan(q, k, v, g, beta, ssm_layer, batch)
            if meta.lead is not None:
                return mixed_gated_delta_rule(q, k, v, g, beta, ssm_layer, batch.state_slots, batch.context_lens,
                                              meta.lead)
        if meta.all_decode:
            return gated_delta_rule_decode(q, k, v, g, beta, ssm_layer, batch.state_slots, batch.context_lens)
        verify = meta.verify
        if verify is not None:  # full: the whole step; else the draft states, before fla rewrites the slots
            out = gated_delta_rule_verify(
                q, k, v, g, beta, ssm_layer, batch.state_slots, meta.cu_seqlens, batch.context_lens,
                verify.draft_table, verify.num_drafts, states_only=not verify.short,
            )
            if out is not None:
                return out
        return chunk_gated_delta_rule_varlen(
            q, k, v, g, beta, ssm_layer, batch.state_slots, meta.cu_seqlens, batch.context_lens,
            batch.query_lens_cpu, chunk_indices=meta.chunks, fresh=meta.fresh, context_lens_cpu=batch.context_lens_cpu,
        )

    def gated_delta(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
        A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_layer: torch.Tensor, batch: ForwardBatch,  # noqa: N803
    ) -> torch.Tensor:
        """All-decode: the step kernel makes the gates itself from a and b (one launch fewer per layer); else
        `delta_gates`, then `gated_delta_rule`; a mixed step's leading decode rows in the step kernel, as in a
        decode step (`fla.mixed_gated_delta_rule`)."""
        meta = _metadata(batch)
        if meta.all_decode:
            return gated_delta_rule_decode(q, k, v, a, b, ssm_layer, batch.state_slots, batch.context_lens,
                                           gates=(A_log, dt_bias))
        g, beta = triton_gates.delta_gates(a, b, A_log, dt_bias)
        if meta.lead is not None:
            return mixed_gated_delta_rule(q, k, v, g, beta, ssm_layer, batch.state_slots, batch.context_lens,
                                          meta.lead, raw_gates=(a, b, A_log, dt_bias))
        return self.gated_delta_rule(q, k, v, g, beta, ssm_layer, batch)

    def ssd_scan(
        self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
        A_log: torch.Tensor, dt_bias: torch.Tensor, D: torch.Tensor, ssm_layer: torch.Tensor,  # noqa: N803
        batch: ForwardBatch, *, dt_limit: tuple[float, float],
    ) -> torch.Tensor:
        """All-decode: one Triton launch over every row (`mamba2/triton_step.py`; CPU tensors: `fla.ssd_decode`, the
        torch step), slots and fresh rows (context_len 1) read on the device (no host sync: a decode graph may capture
        it). A step with prefill rows
        on CUDA: fla's chunked simple-GLA kernels (`mamba2/fla.py`) over every sequence, a mixed step's leading
        decode rows in the step (`mixed_ssd_scan`, the DeltaNet layers' `LeadingDecodes`); its lengths, freshness
        and slots are read on the device and the rows past cu_seqlens[-1] left unwritten, so a whole-step graph
        (`prefill_graphs.SequenceGraphs`, which `masks_padding_rows` allows) captures a one-sequence step on a
        bucket of rows. Verify rows (speculative decoding), and prefill rows on CPU tensors (fla is Triton on CUDA
        only): `backend.mamba2_scan`, the torch reference per sequence from the host lengths."""
        meta, fla = _metadata(batch), mamba2_fla.runs_on(x)
        if not self._said_scan:
            self._said_scan = True
            _logger.info("Mamba2 layers run flash-linear-attention's chunked simple-GLA kernels for prefill and the "
                         "Triton step for decode rows" if fla else "Mamba2 layers run the torch reference scan (fla "
                         "runs on CUDA only)")
        if not meta.all_decode and (batch.draft_rows is not None or not fla):
            return mamba2_scan(x, dt, B, C, A_log, dt_bias, D, ssm_layer, batch, dt_limit=dt_limit, decode=None)
        if meta.all_decode and fla:
            return mamba2_step.ssd_step_update(x, dt, dt_bias, A_log, B, C, D, ssm_layer, batch.state_slots,
                                               batch.context_lens, dt_limit=dt_limit)
        if meta.lead is not None:
            return mamba2_fla.mixed_ssd_scan(x, dt, dt_bias, A_log, B, C, D, ssm_layer, batch.state_slots,
                                             batch.context_lens, meta.lead, dt_limit=dt_limit)
        A = -torch.exp(A_log.float())  # noqa: N806
        steps = mamba2_ref.discretized_dt(dt, dt_bias, dt_limit)
        if meta.all_decode:  # (CPU tensors: the torch step)
            return mamba2_fla.ssd_decode(x, steps, A, B, C, D, ssm_layer, batch.state_slots, batch.context_lens)
        return mamba2_fla.ssd_chunk_scan_varlen(
            x, steps, A, B, C, D, ssm_layer, batch.state_slots, meta.cu_seqlens, batch.context_lens,
            batch.query_lens_cpu, chunk_indices=meta.chunks, fresh=meta.fresh, context_lens_cpu=batch.context_lens_cpu,
        )

    def selective_scan(
        self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
        A_log: torch.Tensor, dt_bias: torch.Tensor, D: torch.Tensor, z: torch.Tensor | None,  # noqa: N803
        ssm_layer: torch.Tensor, batch: ForwardBatch,
    ) -> torch.Tensor:
        """Every step but verify rows: the Triton scan (`mamba1/triton.py`), decode and prefill rows of every
        sequence in one launch, lengths, freshness and slots read on the device and rows past cu_seqlens[-1] left
        unwritten (a decode graph captures it, and a whole-step graph, `prefill_graphs.SequenceGraphs`, a
        one-sequence step on a bucket of rows). Verify rows (speculative decoding), and CPU tensors (Triton runs on
        CUDA only): `backend.mamba1_scan`, the torch reference per sequence from the host lengths."""
        fused = mamba1_triton.runs_on(x)
        if not self._said_selective_scan:
            self._said_selective_scan = True
            _logger.info("Mamba1 layers run the Triton selective scan" if fused else "Mamba1 layers run the torch "
                         "reference selective scan (the Triton scan runs on CUDA only)")
        if not fused or (not _metadata(batch).all_decode and batch.draft_rows is not None):
            return mamba1_scan(x, dt, B, C, A_log, dt_bias, D, z, ssm_layer, batch, decode=None)
        return mamba1_triton.selective_scan_varlen(x, dt, B, C, A_log, dt_bias, D, z, ssm_layer, batch.state_slots,
                                                   batch.cu_seqlens, batch.context_lens)

    def fuses_shared_expert(self, experts: Sequence[nn.Module], shared_expert: nn.Module) -> bool:
        """FP8 experts whose block's shared expert has their format and widths (`triton_fp8_moe.shared_fits`,
        `fp8_tiles.SHARED_AS_EXPERT`): it runs as one more expert of their stack. Once the experts are stacked,
        what their stack holds."""
        stacked = self._experts.get(experts)
        if stacked is not None:
            return isinstance(stacked, Fp8ExpertWeights) and stacked.shared
        return hasattr(experts[0].up_proj, "fmt") and shared_fits(experts, shared_expert)

    def moe(
        self, x: torch.Tensor, top_weights: torch.Tensor, top_ids: torch.Tensor, experts: Sequence[nn.Module],
        shared: tuple[torch.Tensor | None, torch.Tensor | Pending | nn.Module] | None = None,
        activation: str = "silu_gated",
    ) -> torch.Tensor:
        """`experts` must be a module (the block's nn.ModuleList): its stacked weights are kept per module, with
        their activation (a later call with another one is a ValueError; an activation outside
        `moe.reference.EXPERT_ACTIVATIONS` too, naming it). bf16 / fp32 experts add `shared` in the combine's launch
        (a pending output joined right before it, after the expert GEMMs were launched: `grouped_experts`); FP8
        experts (either activation: `fp8_grouped_experts`) with one launch more (joined before it), or, given the
        shared expert's module (`fuses_shared_expert`: SiLU-gated experts), with it stacked as one more expert
        (`fp8_grouped_experts`' `shared_gate`). FP8 experts on fp32 x run the exact path (`fp8_exact`): W8A16 (x
        and h unquantised, each weight tile converted to fp32 in the kernel, IEEE fp32 products) on the checkpoint's
        own scales (block-scaled experts are not re-quantised per channel), equal to the reference backend's
        dequantised experts but for fp32 summation order, as fp32's dense FP8 linears (`gemm/triton_backend.py`)."""
        shared_module = shared[1] if shared is not None and isinstance(shared[1], nn.Module) else None
        exact = fp8_exact(x)
        stacked = self._experts.get(experts)
        if stacked is None:
            if hasattr(experts[0].up_proj, "fmt"):  # FP8 experts (layers/linear.py::Fp8Linear)
                stacked = self._experts[experts] = Fp8ExpertWeights.share(
                    experts, per_channel=False if exact else None, shared=shared_module, activation=activation)
                if not torch.cuda.is_current_stream_capturing():
                    compile_fp8_tiles(x, stacked, top_ids.shape[1], w8a16=exact or None)
            else:
                stacked = self._experts[experts] = ExpertWeights.share(experts, activation)
                if not torch.cuda.is_current_stream_capturing():  # the engine's profiling forward comes first
                    compile_tiles(x, stacked, top_ids.shape[1])
        if stacked.activation != activation:
            raise ValueError(f"moe: these experts were stacked as {stacked.activation!r}, not {activation!r}")
        if shared_module is not None and not (isinstance(stacked, Fp8ExpertWeights) and stacked.shared):
            raise ValueError("moe: a shared expert module is taken only where fuses_shared_expert said so, on "
                             "every call")
        if isinstance(stacked, Fp8ExpertWeights):
            if stacked.shared:
                return fp8_grouped_experts(x, top_weights, top_ids, stacked, w8a16=exact or None,
                                           shared_gate=shared[0])
            routed = fp8_grouped_experts(x, top_weights, top_ids, stacked, w8a16=exact or None)
            return add_shared(routed, shared, triton_activation.sigmoid_gate_add)
        return grouped_experts(x, top_weights, top_ids, stacked, shared)

    step_metadata = staticmethod(_metadata)
    # Element-wise and per-row ops need no step metadata: the kernel functions themselves.
    delta_gates = staticmethod(triton_gates.delta_gates)
    route = staticmethod(triton_route.route)

    @staticmethod
    def route_sigmoid(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, eps: float,
                      scale: float, num_groups: int = 1, topk_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """One Triton launch for one group (`triton_route.route_sigmoid`); grouped routers (none of the served
        models' checkpoints) in torch."""
        if num_groups == 1:
            return triton_route.route_sigmoid(logits, bias, top_k, renormalize, eps, scale)
        return moe_ref.route_sigmoid(logits, bias, top_k, renormalize, eps, scale, num_groups, topk_groups)

    side_stream = staticmethod(streams.side_stream)
    rms_norm = staticmethod(fused_norm.rms_norm)
    add_rms_norm = staticmethod(fused_norm.add_rms_norm)
    gated_rms_norm = staticmethod(fused_norm.gated_rms_norm)
    gated_group_rms_norm = staticmethod(fused_norm.gated_group_rms_norm)
    silu_mul = staticmethod(triton_activation.silu_mul)
    sigmoid_gate_add = staticmethod(triton_activation.sigmoid_gate_add)
    sigmoid_mul = staticmethod(triton_activation.sigmoid_mul)
    relu_square = staticmethod(triton_activation.relu_square)
    rotary = staticmethod(triton_rotary.rotary)
    norm_rotary = staticmethod(triton_rotary.norm_rotary)
