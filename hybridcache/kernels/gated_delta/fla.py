"""Gated delta rule on CUDA over a whole varlen batch: flash-linear-attention's chunked kernel for prefill
chunks, the in-place Triton step kernel (`triton_step`) for decode.

flash-linear-attention (`fla-core`, pure Python + Triton) is imported inside the functions, so importing this
module never imports fla; only CUDA callers reach it (fla in a CPU environment breaks transformers' CPU path).

A prefill chunk calls fla's forward (`chunk_gated_delta_rule_fwd`: the cumsum, intra-chunk, state and output
kernels) directly rather than its public `chunk_gated_delta_rule`, whose argument checks, backend dispatch,
autograd Function and contiguity guard cost host time on every DeltaNet layer of every prefill step (a short
chunk is host-bound). The public entry point's forward backends are off or absent for these calls (FlashQLA is a
separate package), so the same Triton kernels run on the same inputs and the results are bit-identical
(`benchmarks/gdn_prefill_bench.py` checks and times both). This leans on fla's internal layout, hence the
`fla-core` pin to 0.6.x.

Contract of `gated_delta_rule_varlen` (same math as `gated_delta/reference.py`, one call for all
sequences):
    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g [T, Hv] log decay (fp32), or [T, Hv, Dk] a log decay per key channel
    (Kimi Delta Attention, KDA); beta [T, Hv]; rows of sequence i are
    cu_seqlens[i]:cu_seqlens[i+1]. Each sequence starts from ssm_pool[state_slots[i]] (zeros when fresh:
    context_len == query_len) and its final state is written back to that row (in the pool's dtype).
No host sync: the initial states are gathered and the final states scattered with device index ops, fresh rows
are zeroed with a device mask (none when the host lengths show no fresh row), and fla's chunk table is built on
the host from the host query lengths and copied without waiting (`varlen.chunk_indices`).

A mixed step whose first D sequences are decode rows (one token each; the scheduler lists running sequences
first) runs those rows in the step kernel, not as D one-token sequences of fla's, each of which costs fla a state
gathered, a chunk of its state kernel and a state scattered (on next-16b 63 decode rows beside a short prefill made
fla's state kernel 4x the step kernel's time). fla takes every row still, the D decode rows as one throwaway
sequence from a zero state whose final state is dropped (`LeadingDecodes`), so its output covers the step and the
step kernel then writes the D real rows into it: no copy of the output, whatever the prefill's size::

    query lens (1, 1, 1, 40, 7), slots (5, 2, 9, 4, 8)   ->   D = 3: the step kernel on rows 0-2 (slots 5, 2, 9);
    fla on query lens (3, 40, 7), slots (4, 4, 8), the first sequence fresh and its final state not written

A per-channel g (KDA) takes the same path with fla's KDA forward (`chunk_kda_fwd`, `fla_kda_forward`) in place of
the gated-delta one, and the step kernel's per-channel decay (`triton_step`): the same gathered fp32 initial states
in fla's [N, Hv, Dk, Dv] layout (the pool's), fresh rows zeroed, final states scattered, the same leading decode
rows. fla's KDA conventions, matched to the reference: g is the raw per-token log decay (natural log; fla cumulates
it per chunk itself, in log2 units), q and k come l2-normalised by us (`qkv_prep`, as for the per-head rule: fla's
`use_qk_l2norm_in_kernel` is the public entry point's, not the forward's), beta after its sigmoid, scale Dk^-1/2,
initial states fp32, no in-kernel gate (`use_gate_in_kernel` off: the model makes g) and no `safe_gate` (it assumes
g bounded by a lower bound Kimi's gate does not have).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridcache.kernels.gated_delta.qkv_prep import qkv_prep
from hybridcache.kernels.gated_delta.triton_step import gated_delta_rule_decode
from hybridcache.kernels.varlen import any_fresh, fresh_mask, leading_decode_rows
from hybridcache.kernels.varlen import chunk_indices as make_chunk_indices

CHUNK_SIZE = 64  # fla's chunk length for the gated delta rule (and KDA's)


def runs_on(x: torch.Tensor) -> bool:
    """Whether fla's kernels run on x's device: CUDA only (Triton; `CudaBackend.gated_delta_rule` takes the torch
    reference for a per-channel g on CPU tensors). The interpreter tests patch it to run them on the CPU under
    TRITON_INTERPRET."""
    return x.is_cuda


@dataclass(frozen=True)
class LeadingDecodes:
    """fla's view of a mixed step whose first `count` sequences are decode rows (module docstring), built once per
    step by `leading_decodes` and read by every DeltaNet layer.

    count           D, the leading decode rows (0 < D < S)
    slots           [1 + S - D] the state rows fla reads: sequence D's for the throwaway (zeroed by `fresh`, its
                    final state dropped), then state_slots[D:]
    cu_seqlens      [2 + S - D] int64: 0, then cu_seqlens[D:]
    fresh           [1 + S - D] bool: True for the throwaway, then the fresh mask of sequences D..S-1
    query_lens_cpu  (D, query_lens_cpu[D:])
    chunks          fla's chunk table of that layout
    """

    count: int
    slots: torch.Tensor
    cu_seqlens: torch.Tensor
    fresh: torch.Tensor
    query_lens_cpu: tuple[int, ...]
    chunks: torch.Tensor


def leading_decodes(cu_seqlens: torch.Tensor, context_lens: torch.Tensor, state_slots: torch.Tensor,
                    query_lens_cpu: Sequence[int]) -> LeadingDecodes | None:
    """The step's `LeadingDecodes`, or None unless it starts with a decode row and has a longer chunk after its
    run of decode rows (an all-decode step takes the step kernel alone; one that starts with a prefill chunk, fla
    alone)."""
    count = leading_decode_rows(query_lens_cpu)
    if count == 0 or count == len(query_lens_cpu):
        return None
    cu = cu_seqlens.long()
    fla_cu = torch.cat([cu[:1], cu[count:]])
    lens = (count, *query_lens_cpu[count:])
    fresh = torch.cat([torch.ones(1, dtype=torch.bool, device=cu.device), fresh_mask(cu, context_lens)[count:]])
    slots = torch.cat([state_slots[count: count + 1], state_slots[count:]])
    return LeadingDecodes(count=count, slots=slots, cu_seqlens=fla_cu, fresh=fresh, query_lens_cpu=lens,
                          chunks=make_chunk_indices(fla_cu, lens, CHUNK_SIZE))


def fla_chunk_forward() -> Callable:
    """fla's chunked forward (`chunk_gated_delta_rule_fwd`), the dots of its fused triangular solve set to IEEE fp32
    first. fla 0.6 fixes them to tf32 on NVIDIA GPUs of compute capability >= 8 (`chunk_fwd.SOLVE_TRIL_DOT_PRECISION`,
    whatever `TRITON_F32_DEFAULT` says), so an fp32 engine was not IEEE fp32 there and its outputs moved with the
    chunking, which is what prefix caching changes (measured: docs/bench.md, session 51). The solve works on
    16 x 16 fp32 tiles in every dtype (the inverse of the chunk's fp32 K K^T blocks), so IEEE applies to bf16
    models too; it costs FMA time on small tiles, no bytes.

    The setting must come before the kernel compiles (Triton refuses to launch a kernel whose global changed after
    it compiled), so every caller of fla's chunked rule in this process comes through here: the engine's
    `chunk_gated_delta_rule_varlen`, and benchmarks that also call fla's public API call this first. The value is
    made with the class of the one it replaces (Triton's `constexpr`), so this module never imports Triton."""
    from fla.ops.gated_delta_rule import chunk_fwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    _solve_in_ieee(chunk_fwd)
    return chunk_gated_delta_rule_fwd


def fla_kda_forward() -> Callable:
    """fla's chunked KDA forward (`fla.ops.kda.chunk_fwd.chunk_kda_fwd`), its fused inter-block + triangular solve
    kernel's dots set to IEEE fp32 first (`chunk_intra.SOLVE_TRIL_DOT_PRECISION`, tf32 on NVIDIA GPUs in fla 0.6, as
    for the per-head rule: `fla_chunk_forward`)."""
    from fla.ops.kda import chunk_intra
    from fla.ops.kda.chunk_fwd import chunk_kda_fwd

    _solve_in_ieee(chunk_intra)
    return chunk_kda_fwd


def _solve_in_ieee(module) -> None:
    """Set `module.SOLVE_TRIL_DOT_PRECISION` (fla's) to IEEE fp32, in the class of the value it replaces."""
    current = getattr(module, "SOLVE_TRIL_DOT_PRECISION", None)
    if current is None:  # setting it would do nothing: say so
        name = module.__name__.rsplit(".", 1)[-1]
        raise ImportError(f"fla-core's {name} has no SOLVE_TRIL_DOT_PRECISION: hybridcache needs fla-core 0.6.x "
                          "(pip install 'fla-core>=0.6,<0.7')")
    if getattr(current, "value", current) != "ieee":
        module.SOLVE_TRIL_DOT_PRECISION = type(current)("ieee")


def chunk_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_pool: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens_cpu: Sequence[int],
    *,
    use_qk_l2norm: bool = True,
    chunk_indices: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    context_lens_cpu: Sequence[int] | None = None,
    drop_first: bool = False,
) -> torch.Tensor:
    """fla's chunked gated delta rule over every sequence of the batch (see the module docstring).

    ssm_pool [num_slots, Hv, Dk, Dv]; state_slots [S] distinct; context_lens [S]; chunk_indices: the
    `varlen.chunk_indices(cu_seqlens, query_lens_cpu, 64)` table, and fresh the `varlen.fresh_mask(cu_seqlens,
    context_lens)` one, when the caller already has them (computed once per step, not per layer).
    context_lens_cpu: context_lens on the host (the true ones, not a captured batch's claim), when the caller has
    them: a batch with no fresh sequence (`varlen.any_fresh`: prefix hits, decode rows) then reads its state rows
    as they are, without the mask's launches. `drop_first`: sequence 0 is a throwaway (`LeadingDecodes`): its
    final state is not written back (its slot is read, so it must be a valid row; `fresh` must zero it).
    A per-channel g [T, Hv, Dk] (KDA) runs fla's KDA forward (`fla_kda_forward`), a per-head one [T, Hv] its gated
    delta rule. Returns out [T, Hv, Dv] in q's dtype.
    """
    per_channel = g.dim() == 3
    cu = cu_seqlens.long()
    if chunk_indices is None:
        chunk_indices = make_chunk_indices(cu, query_lens_cpu, CHUNK_SIZE)
    slots = state_slots.long()
    initial = ssm_pool.index_select(0, slots).float()
    if context_lens_cpu is None or any_fresh(context_lens_cpu, query_lens_cpu):
        if fresh is None:
            fresh = fresh_mask(cu, context_lens)
        initial = initial.masked_fill(fresh[:, None, None, None], 0.0)
    if use_qk_l2norm:  # ours, not fla's in-kernel one (fla autotunes that per size bucket, norm/triton.py), with
        q, k, v = qkv_prep(q, k, v)  # v made contiguous in the same launch
    # fla's kernels address [1, T, H, D] inputs as contiguous (its public entry point copies strided views)
    inputs = {"q": q.unsqueeze(0).contiguous(), "k": k.unsqueeze(0).contiguous(), "v": v.unsqueeze(0).contiguous(),
              "g": g.float().unsqueeze(0).contiguous(), "beta": beta.unsqueeze(0).contiguous(),
              "scale": q.shape[-1] ** -0.5, "initial_state": initial, "output_final_state": True, "cu_seqlens": cu,
              "chunk_indices": chunk_indices.long()}
    if per_channel:  # (o, final_state, then what its backward keeps)
        # fla's token-parallel KDA kernel finds a row's sequence by a binary search over cu_seqlens and, for a row
        # past the last sequence (a padded bucket's: `masks_padding_rows`), reads the entry after the last: give it
        # one, the row count, so such rows make a throwaway segment of their own rather than read past the tensor
        inputs["cu_seqlens"] = torch.cat([cu, cu.new_full((1,), q.shape[0])])[:-1]
        out, final = fla_kda_forward()(**inputs)[:2]
    else:
        _, out, _, final, _, _ = fla_chunk_forward()(**inputs)
    if drop_first:
        slots, final = slots[1:], final[1:]
    ssm_pool.index_copy_(0, slots, final.to(ssm_pool.dtype))
    return out[0].to(q.dtype)


def mixed_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_pool: torch.Tensor,
    state_slots: torch.Tensor,
    context_lens: torch.Tensor,
    lead: LeadingDecodes,
    *,
    use_qk_l2norm: bool = True,
    raw_gates: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """A mixed step with `lead.count` leading decode rows (module docstring): fla over every row, the decode rows as
    one throwaway sequence, then the step kernel writes their real outputs over its rows and updates their state
    rows. Same contract and result as `chunk_gated_delta_rule_varlen` over the step (to fp32 rounding: the decode
    rows' sums run in the step kernel's order); a per-channel g too (KDA; not with `raw_gates`). `raw_gates` (a, b
    [T, Hv], A_log, dt_bias [Hv]): the step kernel makes the decode rows' gates itself from them, the launch a
    decode step compiles and runs (g and beta: fla's)."""
    out = chunk_gated_delta_rule_varlen(
        q, k, v, g, beta, ssm_pool, lead.slots, lead.cu_seqlens, context_lens, lead.query_lens_cpu,
        use_qk_l2norm=use_qk_l2norm, chunk_indices=lead.chunks, fresh=lead.fresh, drop_first=True,
    )
    d = lead.count
    rows = (g[:d], beta[:d], None) if raw_gates is None else (raw_gates[0][:d], raw_gates[1][:d], raw_gates[2:])
    gated_delta_rule_decode(q[:d], k[:d], v[:d], rows[0], rows[1], ssm_pool, state_slots[:d], context_lens[:d],
                            use_qk_l2norm=use_qk_l2norm, gates=rows[2], out=out[:d])
    return out


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_pool: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens_cpu: Sequence[int],
    *,
    use_qk_l2norm: bool = True,
    chunk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Any batch: all-decode batches (every query_len == 1) take the in-place step kernel, a run of leading decode
    rows before a prefill chunk `mixed_gated_delta_rule`, others fla's chunked kernel for every sequence. Same
    contract as `chunk_gated_delta_rule_varlen`."""
    if all(length == 1 for length in query_lens_cpu):
        return gated_delta_rule_decode(
            q, k, v, g, beta, ssm_pool, state_slots, context_lens, use_qk_l2norm=use_qk_l2norm
        )
    lead = leading_decodes(cu_seqlens, context_lens, state_slots, query_lens_cpu)
    if lead is not None:
        return mixed_gated_delta_rule(q, k, v, g, beta, ssm_pool, state_slots, context_lens, lead,
                                      use_qk_l2norm=use_qk_l2norm)
    return chunk_gated_delta_rule_varlen(
        q, k, v, g, beta, ssm_pool, state_slots, cu_seqlens, context_lens, query_lens_cpu,
        use_qk_l2norm=use_qk_l2norm, chunk_indices=chunk_indices,
    )
