"""Mamba2's selective state space scan (SSD) on CUDA over a whole varlen batch: flash-linear-attention's chunked
simple-GLA kernels for prefill chunks; decode rows through `triton_step.py` (one launch; `ssd_decode`, the torch step,
for CPU tensors).

Per head, Mamba2's recurrence (`reference.py`) is fla's simple GLA, a scalar log decay per token and head::

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,  o_t = q_t S_t  (scale 1),   y_t = o_t + D x_t
    q = C, k = B (of the head's group), v = dt * x, g = dt * A   (dt discretized, A = -exp(A_log))

Our state row [H, P, N] is fla's V-first layout ([V, K], `state_v_first`: V = the value dim P, K = the key dim N),
so the pool rows are gathered and scattered as they are, no transpose. The D skip is added outside.

flash-linear-attention (`fla-core`, pure Python + Triton) is imported inside the functions, so importing this
module never imports fla; only CUDA callers reach it (fla in a CPU environment breaks transformers' CPU path).

fla's forward (`simple_gla.chunk.chunk_simple_gla_fwd`) is not called: its state kernel's launcher
(`common.chunk_h.chunk_fwd_h`) reads the number of chunks back from the device (`.item()`, a host sync on every
layer, and an error inside a CUDA graph capture). We launch its three Triton kernels ourselves, as its public
entry point does after its own preparation:

    chunk_local_cumsum      g -> its cumulative sum inside each 64-token chunk, in log2 units (the kernels use exp2)
    chunk_fwd_kernel_h      the state entering each chunk (kept in k's dtype, fla's `states_in_fp32=False`; the
                            running state stays fp32 in registers) and each sequence's final state (fp32)
    chunk_fwd_kernel_o      each chunk's output: C . (entering state) + the masked decayed C B^T "attention" over v

with the number of chunks from the host query lengths and the chunk offsets from fla's own device-side helper
(`prepare_chunk_offsets`, memoised by cu_seqlens' identity, as the gated delta rule's launcher uses it). The output
kernel is launched on an fp32 output buffer (fla's launcher allocates v's dtype), so a bf16 model's scan output is
rounded once, by the layer's norm, as the reference's is. This leans on fla's internal kernel signatures, hence
the `fla-core` pin to 0.6.x (`fla_kernels` checks it).

fla's state kernel takes k with v's heads (the output kernel reads q and k per group, `HV // H`), so B is repeated
to the heads (one [T, H, N] copy); C is read per group. Everything else follows `gated_delta/fla.py`: no host sync
(initial states gathered and final states scattered with device index ops, fresh rows zeroed with a device mask,
none when the host lengths show no fresh row, fla's chunk table built from the host lengths and copied without
waiting), and a mixed step's leading decode rows run in the step, fla taking them as one throwaway sequence from a
zero state whose final state is dropped (`gated_delta.fla.LeadingDecodes`, the same table: both chunk at 64).

Precision (the interpreter on the CPU against `reference.ssd_chunk_scan` in fp32, `tests/kernels/test_mamba2_cuda.py`):
fp32 inputs agree to ~1e-5; bf16 inputs round B, C and dt * x to bf16 before the products (as mamba_ssm's kernels
do), a relative error of a few bf16 steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch

from hybridcache.kernels.gated_delta.fla import CHUNK_SIZE, LeadingDecodes
from hybridcache.kernels.mamba2 import reference as mamba2_ref
from hybridcache.kernels.varlen import any_fresh, fresh_mask
from hybridcache.kernels.varlen import chunk_indices as make_chunk_indices

# CHUNK_SIZE (64) is the gated delta rule's: `CudaBackend.prepare` builds one chunk table per step
# (`CudaMetadata.chunks`, `LeadingDecodes.chunks`) that both recurrent families' fla kernels read.


def fla_kernels() -> SimpleNamespace:
    """fla's `ops` modules this scan launches from, after checking the pinned release (the kernels' argument
    names are fla's internals): a namespace with `cumsum`, `chunk_h`, `chunk_o` and `index`."""
    import fla
    from fla.ops.common import chunk_h, chunk_o
    from fla.ops.utils import cumsum, index

    if not fla.__version__.startswith("0.6."):
        raise ImportError(f"hybridcache launches fla-core 0.6's simple-GLA kernels directly, found fla-core "
                          f"{fla.__version__} (pip install 'fla-core>=0.6,<0.7')")

    return SimpleNamespace(cumsum=cumsum, chunk_h=chunk_h, chunk_o=chunk_o, index=index)


def runs_on(x: torch.Tensor) -> bool:
    """Whether fla's kernels run on x's device: CUDA only (Triton; `CudaBackend.ssd_scan` takes the torch reference
    for prefill rows on CPU tensors). The interpreter tests patch it to run them on the CPU under TRITON_INTERPRET."""
    return x.is_cuda


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def simple_gla_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, initial: torch.Tensor,
                      cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's chunked simple GLA forward, scale 1, V-first states, over a varlen batch (module docstring).

    q, k [1, T, G, K] per group; v [1, T, H, V] per head (H a multiple of G: head h reads group h // (H / G));
    q, k, v one dtype, contiguous; g [1, T, H] fp32 log decay; initial [S, H, V, K] fp32; cu_seqlens [S + 1] int64;
    chunk_indices: `varlen.chunk_indices(cu_seqlens, lengths, 64)`, whose row count is the number of chunks.
    Returns o [1, T, H, V] fp32, final [S, H, V, K] fp32. Rows past cu_seqlens[-1] are not written."""
    kernels = fla_kernels()
    _, num_tokens, num_groups, key_dim = k.shape
    num_heads, value_dim, num_seqs = v.shape[2], v.shape[-1], cu_seqlens.shape[0] - 1
    num_chunks = chunk_indices.shape[0]
    g = kernels.cumsum.chunk_local_cumsum(g, chunk_size=CHUNK_SIZE, scale=1.4426950408889634,  # 1 / ln 2
                                          cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    offsets = kernels.index.prepare_chunk_offsets(cu_seqlens, CHUNK_SIZE)  # device ops, memoised per cu_seqlens
    h = k.new_empty(1, num_chunks, num_heads, value_dim, key_dim)
    final = k.new_empty(num_seqs, num_heads, value_dim, key_dim, dtype=torch.float32)

    def h_grid(meta: dict) -> tuple[int]:
        return (_cdiv(key_dim, meta["BK"]) * _cdiv(value_dim, meta["BV"]) * num_seqs * num_heads,)

    k_heads = k.repeat_interleave(num_heads // num_groups, dim=2) if num_groups < num_heads else k  # v's heads
    kernels.chunk_h.chunk_fwd_kernel_h[h_grid](
        k=k_heads, v=v, h=h, g=g, g_gamma=None, gk=None, gv=None, h0=initial, ht=final, cu_seqlens=cu_seqlens,
        split_offsets=offsets, T=num_tokens, H=num_heads, K=key_dim, V=value_dim, BT=CHUNK_SIZE, BS=CHUNK_SIZE,
        USE_G=True, USE_G_GAMMA=False, USE_GK=False, USE_GV=False, STATE_V_FIRST=True,
    )
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)

    def o_grid(meta: dict) -> tuple[int, int]:
        return (_cdiv(value_dim, meta["BV"]) * num_chunks, num_heads)

    kernels.chunk_o.chunk_fwd_kernel_o[o_grid](
        q=q, k=k, v=v, h=h, g=g,
        g_gamma=None, o=o, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=1.0, T=num_tokens,
        H=num_groups, HV=num_heads, K=key_dim, V=value_dim, BT=CHUNK_SIZE, STATE_V_FIRST=True,
    )
    return o, final


def ssd_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,  # noqa: N803 (the paper's names)
    B: torch.Tensor,  # noqa: N803
    C: torch.Tensor,  # noqa: N803
    D: torch.Tensor,  # noqa: N803
    ssm_pool: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens_cpu: Sequence[int],
    *,
    chunk_indices: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    context_lens_cpu: Sequence[int] | None = None,
    drop_first: bool = False,
) -> torch.Tensor:
    """fla's chunked scan over every sequence of the batch (module docstring); the math of `reference.ssd_chunk_scan`
    per sequence.

    x [T, H, P]; dt [T, H] discretized (`reference.discretized_dt`); A, D [H] fp32 (A = -exp(A_log)); B, C [T, G, N]
    (any strides); rows of sequence i are cu_seqlens[i]:cu_seqlens[i+1]. Each sequence starts from
    ssm_pool[state_slots[i]] ([num_slots, H, P, N]; zeros when fresh: context_len == query_len) and its final state
    is written back to that row (in the pool's dtype). chunk_indices, fresh, context_lens_cpu, drop_first: as
    `gated_delta.fla.chunk_gated_delta_rule_varlen` takes them. q, k, v go to fla in x's dtype.
    Returns y [T, H, P] fp32, the D skip included."""
    cu = cu_seqlens.long()
    if chunk_indices is None:
        chunk_indices = make_chunk_indices(cu, query_lens_cpu, CHUNK_SIZE)
    slots = state_slots.long()
    initial = ssm_pool.index_select(0, slots).float()  # [S, H, P, N]: fla's V-first [V, K] per head
    if context_lens_cpu is None or any_fresh(context_lens_cpu, query_lens_cpu):
        if fresh is None:
            fresh = fresh_mask(cu, context_lens)
        initial = initial.masked_fill(fresh[:, None, None, None], 0.0)
    dt = dt.float()
    v = (x * dt[..., None]).to(x.dtype)
    g = dt * A.float()
    out, final = simple_gla_varlen(*(t.unsqueeze(0).contiguous() for t in (C, B, v, g)), initial, cu,
                                   chunk_indices.long())
    if drop_first:
        slots, final = slots[1:], final[1:]
    ssm_pool.index_copy_(0, slots, final.to(ssm_pool.dtype))
    return out[0].addcmul_(x, D.float()[:, None])


def ssd_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,  # noqa: N803
    B: torch.Tensor,  # noqa: N803
    C: torch.Tensor,  # noqa: N803
    D: torch.Tensor,  # noqa: N803
    ssm_pool: torch.Tensor,
    state_slots: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """One token of each of M sequences through `reference.ssd_step`, on the device only (graph-safe): state rows
    ssm_pool[state_slots], fresh rows (context_len 1) read as zeros, the new states written back. x [M, H, P];
    dt [M, H] discretized; B, C [M, G, N]. Returns y [M, H, P] fp32. The torch step of CPU tensors (CUDA runs
    `triton_step.ssd_step_update`: one launch, the rows updated in place)."""
    state = ssm_pool.index_select(0, state_slots)
    state = torch.where((context_lens == 1)[:, None, None, None], torch.zeros_like(state), state)
    y, state = mamba2_ref.ssd_step(x, dt, A, B, C, D, state)
    ssm_pool.index_copy_(0, state_slots, state.to(ssm_pool.dtype))
    return y


def mixed_ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,  # noqa: N803
    B: torch.Tensor,  # noqa: N803
    C: torch.Tensor,  # noqa: N803
    D: torch.Tensor,  # noqa: N803
    ssm_pool: torch.Tensor,
    state_slots: torch.Tensor,
    context_lens: torch.Tensor,
    lead: LeadingDecodes,
    *,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """A mixed step with `lead.count` leading decode rows (dt: in_proj's raw output): fla over every row, the decode
    rows as one throwaway sequence, then the step launch (`triton_step.ssd_step_update`) writes their real outputs
    over its rows and updates their state rows. Same contract and result as `ssd_chunk_scan_varlen` over the step
    (to fp32 rounding)."""
    from hybridcache.kernels.mamba2 import triton_step

    A = -torch.exp(A_log.float())  # noqa: N806
    steps = mamba2_ref.discretized_dt(dt, dt_bias, dt_limit)
    out = ssd_chunk_scan_varlen(x, steps, A, B, C, D, ssm_pool, lead.slots, lead.cu_seqlens, context_lens,
                                lead.query_lens_cpu, chunk_indices=lead.chunks, fresh=lead.fresh, drop_first=True)
    d = lead.count
    triton_step.ssd_step_update(x[:d], dt[:d], dt_bias, A_log, B[:d], C[:d], D, ssm_pool, state_slots[:d],
                                context_lens[:d], dt_limit=dt_limit, out=out[:d])
    return out
