"""One decode step of the gated delta rule on CUDA (Triton), reading and writing the state pool in place.

Same math as `gated_delta/reference.py::gated_delta_rule_step`, per sequence n and value head h (S is [Dk, Dv], fp32):
    q, k = l2norm(q), l2norm(k) (when use_qk_l2norm);  q = q * Dk^-1/2
    S = exp(g) S;  S = S + k (beta (v - S^T k))^T;  o = S^T q
with S = ssm_pool[state_slots[n], h] (zeros when context_len == 1: a fresh sequence) and the new S written
back to the same row. Key head h // (Hv / Hk) serves value head h. A per-channel g [N, Hv, Dk] (Kimi Delta
Attention) decays each row of S at its own rate, S = diag(exp(g)) S: the same kernel, g loaded as a column
(`token_inputs`' GATE_DK).

Grid (cdiv(Dv, BLOCK_V), Hv, N) (V_MAJOR; else (N, Hv, cdiv(Dv, BLOCK_V))): each program owns a [Dk, BLOCK_V]
column block of one state, so the state is read once and written once (the bytes floor of decode), with no
gather/scatter copies; with V_MAJOR the column blocks of a state's rows are neighbouring programs (read close in
time: fewer DRAM row openings); with STREAM the state's load asks to be evicted first and its store streams
(`.cs`): no cache keeps a state the step will not read again.
flash-linear-attention's fused recurrent kernel takes dense [N, Hv, Dk, Dv] states, which would need a gather and
a scatter around it (three times the state traffic).

Any head dims (`head_tiles`): the key tile is Dk rounded up to a power of two (BLOCK_K) and the value tile BLOCK_V
min(64, Dv rounded up), the entries past Dk / Dv masked (`lanes_below`): their loads give 0, so q, k and v add
nothing to the l2 norms and the k . S and S^T q sums, the state rows past Dk stay 0, and nothing past Dk / Dv is
stored. Olmo-Hybrid-7B (Dk 96, Dv 192): [128, 64] tiles of which 96 rows are real, three column blocks, no value
column masked. Where a dim fills its tiles (power-of-two dims) its mask is a compile-time constant True, which the
compiler drops: the engine's launches at power-of-two dims compile to the PTX they compiled to before the kernel
took other dims (debug lines aside; checked once, session 63; test_hopper_compile.py checks that no lane compare
is left).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.kernels import pdl
from hybridcache.kernels.gated_delta.triton_gates import gate_values

# [Dk, 64] state tiles with the streaming hints: 75 us a launch at dense-9b's 64 x 32 heads against 84 us with
# [Dk, 32] tiles and no hints (3.57 against 3.21 TB/s; torch's copy of the same bytes 4.09), the fastest of 18
# launches (docs/bench.md, issue 32's sixth pass: `benchmarks/decode_kernel_sweep.py`). V_MAJOR: the grid
# (Dv / BLOCK_V, Hv, N), so the two column blocks of a state's rows are read by neighbouring programs: 72.5 against
# 74.3 us, the same bits (docs/bench.md, session 44, dec17a)
_BLOCK_V = 64
_STREAM = True
_V_MAJOR = True


def head_tiles(k_dim: int, v_dim: int, max_block_v: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_V) for head dims Dk, Dv: Dk rounded up to a power of two, and Dv rounded up to one but at most
    `max_block_v` (a power of two); the programs span cdiv(Dv, BLOCK_V) column blocks."""
    return triton.next_power_of_2(k_dim), min(max_block_v, triton.next_power_of_2(v_dim))


@triton.jit
def lanes_below(offsets, DIM: tl.constexpr, BLOCK: tl.constexpr):
    """offsets < DIM for a tile's `offsets` [BLOCK]: a constant True when no tile reaches past DIM (DIM a multiple
    of BLOCK, e.g. a power-of-two head dim), so the compiler drops the masks made of it and the loads and stores
    compile as unmasked ones."""
    if DIM % BLOCK == 0:
        return tl.full([BLOCK], 1, tl.int1)
    else:
        return offsets < DIM


@triton.jit
def program_heads(RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_V: tl.constexpr, V_MAJOR: tl.constexpr = False):
    """What a program of grid (sequences, Hv, cdiv(Dv, BLOCK_V)) works on (V_MAJOR: grid (cdiv(Dv, BLOCK_V), Hv,
    sequences), the column blocks of a state's rows in neighbouring programs): returns (seq, its value head, that
    head's key head (RATIO value heads share one), the key entries ks [BLOCK_K] (Dk rounded up to a power of two),
    the program's value entries vs [BLOCK_V], and which of them are real: ks < DK, vs < DV (`lanes_below`))."""
    seq = tl.program_id(2 if V_MAJOR else 0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    pid_v = tl.program_id(0 if V_MAJOR else 2)
    key_head = head // RATIO
    ks = tl.arange(0, BLOCK_K)
    vs = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    return seq, head, key_head, ks, vs, lanes_below(ks, DK, BLOCK_K), lanes_below(vs, DV, BLOCK_V)


@triton.jit
def token_inputs(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, row, head, key_head, ks, vs, k_in, v_in, scale, stride_qt,
                 stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, L2NORM: tl.constexpr,
                 GATE_DK: tl.constexpr = 0):
    """Token `row`'s inputs to the gated delta rule in fp32, for value head `head` (key head `key_head`): q and k
    [BLOCK_K] at entries ks of the key head, v [BLOCK_V] at entries vs of the value head (the entries where k_in /
    v_in are False load as 0, so they add nothing to the norms and products), and the head's log decay g and write
    strength beta. Returns (q, k, v, g, beta), q and k l2-normalised when L2NORM and q scaled by `scale`.
    g is the head's scalar, or with GATE_DK > 0 (a per-channel decay, Kimi Delta Attention: g rows [Hv, GATE_DK]
    contiguous) its [BLOCK_K, 1] column of decays at entries ks (0 past Dk: exp(0) leaves the zero rows zero), so
    `delta_rule_update`'s exp(g) S scales each state row by its own decay.
    With `delta_rule_update`, the per-token work of the step kernel and of the verify kernel (`triton_verify.py`).
    The addresses are formed here, beside their loads: passed in precomputed, they reorder the step kernel's code."""
    bq = tl.load(q_ptr + row * stride_qt + key_head * stride_qh + ks, mask=k_in, other=0.0).to(tl.float32)
    bk = tl.load(k_ptr + row * stride_kt + key_head * stride_kh + ks, mask=k_in, other=0.0).to(tl.float32)
    if L2NORM:
        bq = bq / tl.sqrt(tl.sum(bq * bq) + 1e-6)
        bk = bk / tl.sqrt(tl.sum(bk * bk) + 1e-6)
    bq = bq * scale
    bv = tl.load(v_ptr + row * stride_vt + head * stride_vh + vs, mask=v_in, other=0.0).to(tl.float32)
    if GATE_DK > 0:
        bg = tl.load(g_ptr + row * stride_gt + head * GATE_DK + ks, mask=k_in, other=0.0).to(tl.float32)[:, None]
    else:
        bg = tl.load(g_ptr + row * stride_gt + head).to(tl.float32)
    bb = tl.load(beta_ptr + row * stride_bt + head).to(tl.float32)
    return bq, bk, bv, bg, bb


@triton.jit
def delta_rule_update(state, bk, bv, bg, bb):
    """The fp32 state block [BLOCK_K, BLOCK_V] after one token's k, v, g, beta (`token_inputs`; g a scalar or a
    [BLOCK_K, 1] column of per-row decays): S = exp(g) S;  S = S + k (beta (v - S^T k))^T. Rows past Dk that are 0
    in `state` and `bk` stay 0."""
    state = state * tl.exp(bg)
    delta = (bv - tl.sum(state * bk[:, None], axis=0)) * bb
    return state + bk[:, None] * delta[None, :]


# g and beta are often the raw a and b: column views of the layer's projection output in an eager step (16-byte
# aligned or not by the widths before them), copies in the pieces' staging buffers in a piecewise-graph step (a
# mixed step's decode rows). Their alignment depends on the path, so no variant is compiled on it.
@triton.jit(do_not_specialize_on_alignment=["g_ptr", "beta_ptr"])
def _gdn_step_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, pool_ptr, slots_ptr, ctx_ptr, alog_ptr, dt_ptr, scale,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_bn, stride_on, stride_oh,
    stride_ps, stride_ph, stride_pk,
    RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr, GATES: tl.constexpr, PDL: tl.constexpr, STREAM: tl.constexpr = False,
    V_MAJOR: tl.constexpr = False, GATE_DK: tl.constexpr = 0,
):
    pdl.start(PDL)
    seq, head, key_head, ks, vs, k_in, v_in = program_heads(RATIO, DK, DV, BLOCK_K, BLOCK_V, V_MAJOR)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    rows_to_read = DK * (tl.load(ctx_ptr + seq) != 1).to(tl.int32)  # 0 for a fresh sequence

    bq, bk, bv, bg, bb = token_inputs(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, seq, head, key_head, ks, vs, k_in, v_in,
                                      scale, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                                      stride_gn, stride_bn, L2NORM, GATE_DK)
    if GATES:  # g_ptr / beta_ptr hold the raw a / b: the gates here, as `triton_gates` makes them
        bg, bb = gate_values(bg, bb, tl.load(alog_ptr + head).to(tl.float32), tl.load(dt_ptr + head).to(tl.float32))
        bb = bb.to(beta_ptr.dtype.element_ty).to(tl.float32)
    state_ptrs = pool_ptr + slot * stride_ps + head * stride_ph + ks[:, None] * stride_pk + vs[None, :]
    read = (ks < rows_to_read)[:, None] & v_in[None, :]  # (rows_to_read <= DK: the rows past Dk read 0)
    if STREAM:  # the state is read once and written once per step: hint that no cache should keep it
        state = tl.load(state_ptrs, mask=read, other=0.0, eviction_policy="evict_first")
    else:
        state = tl.load(state_ptrs, mask=read, other=0.0)
    state = delta_rule_update(state.to(tl.float32), bk, bv, bg, bb)  # [BLOCK_K, BLOCK_V]
    out = tl.sum(state * bq[:, None], axis=0)
    tl.store(out_ptr + seq * stride_on + head * stride_oh + vs, out.to(out_ptr.dtype.element_ty), mask=v_in)
    write = k_in[:, None] & v_in[None, :]
    if STREAM:
        tl.store(state_ptrs, state.to(pool_ptr.dtype.element_ty), mask=write, cache_modifier=".cs")
    else:
        tl.store(state_ptrs, state.to(pool_ptr.dtype.element_ty), mask=write)


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_pool: torch.Tensor,
    state_slots: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    use_qk_l2norm: bool = True,
    gates: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token for each of N sequences; ssm_pool[state_slots] is updated in place.

    `gates` (A_log, dt_bias [Hv]): g and beta are then the raw a and b [N, Hv] (strided rows allowed, e.g. slices
    of Qwen3-Next's in_proj_ba output) and the kernel makes the gates itself, as `triton_gates.delta_gates` does
    (the same code: the same bits), which saves that launch per layer and step.

    q, k [N, Hk, Dk]; v [N, Hv, Dv] (unit stride on the last dim; other strides free, e.g. views of the conv
    output); g, beta [N, Hv] (log decay, write strength), or g [N, Hv, Dk] a log decay per key channel (Kimi Delta
    Attention: S = diag(exp(g)) S; not with `gates`); ssm_pool [num_slots, Hv, Dk, Dv] (fp32 normally);
    state_slots [N] distinct; context_lens [N] (1 = fresh). Any Dk and Dv (`head_tiles`).
    Returns out [N, Hv, Dv] in q's dtype: a new tensor, or `out` written (unit stride on Dv; a mixed step's
    leading rows of fla's output, `fla.mixed_gated_delta_rule`).
    """
    num, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1], v.shape[2]
    block_k, block_v = head_tiles(k_dim, v_dim, _BLOCK_V)
    if ssm_pool.stride(-1) != 1 or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v and ssm_pool need unit stride on their last dim")
    per_channel = g.dim() == 3
    if per_channel and (gates is not None or tuple(g.shape) != (num, num_v_heads, k_dim)):
        raise ValueError(f"a per-channel g must be [{num}, {num_v_heads}, {k_dim}] raw log decays (no `gates`), got "
                         f"{list(g.shape)}")
    if gates is None or g.stride(-1) != 1 or beta.stride(-1) != 1:
        g, beta = g.contiguous(), beta.contiguous()
    a_log, dt_bias = gates if gates is not None else (g, g)  # (unread without gates)
    if out is None:
        out = torch.empty(num, num_v_heads, v_dim, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != (num, num_v_heads, v_dim) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [{num}, {num_v_heads}, {v_dim}] in {q.dtype} with unit stride on its last "
                         f"dim, got {list(out.shape)} in {out.dtype}")
    if num == 0:
        return out
    blocks = triton.cdiv(v_dim, block_v)
    _gdn_step_kernel[(blocks, num_v_heads, num) if _V_MAJOR else (num, num_v_heads, blocks)](
        q, k, v, g, beta, out, ssm_pool, state_slots, context_lens, a_log, dt_bias, k_dim**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), ssm_pool.stride(0), ssm_pool.stride(1), ssm_pool.stride(2),
        RATIO=num_v_heads // num_k_heads, DK=k_dim, DV=v_dim, BLOCK_K=block_k, BLOCK_V=block_v, L2NORM=use_qk_l2norm,
        GATES=gates is not None, STREAM=_STREAM, V_MAJOR=_V_MAJOR, GATE_DK=k_dim if per_channel else 0,
        **pdl.options(q),
    )
    return out
