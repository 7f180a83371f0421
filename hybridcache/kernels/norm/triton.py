"""Fused row norms on CUDA (Triton): one launch per norm instead of torch's five or six elementwise kernels.
Same math and the same roundings as `layers.norm` / the references (each row of the last dim on its own; a
program takes 2,048 // width rows, see `_launch`):

- `rms_norm`: n = x / rms(x) in fp32, then the weight as `reference.Weighting` says (ZeroCenteredRMSNorm: n * (1 + w),
  rounded once to x's dtype; the other families' RMSNorm: w * round(n) rounded, or w * n rounded once).
- `add_rms_norm` (a decoder layer's residual add and the next norm): s = x + residual rounded to x's dtype (as
  torch's add rounds it), written out, and rms_norm(s) from the rounded s: one launch for what took two.
- `gated_rms_norm` (GatedRMSNorm of DeltaNet outputs): n = (x / rms(x)) rounded to x's dtype; p = w * n rounded
  to x's dtype (the module multiplies in the weight's dtype); y = p * silu(gate) in fp32, rounded once.
- `gated_group_rms_norm` (Mamba2's gated norm): the gate's SiLU, the norm over each group of channels and the weight
  in fp32, rounded once to the gate's dtype (x is the scan's fp32 output): one launch for torch's eleven.
- `l2norm` (the gated delta rule's q / k): y = x / sqrt(sum(x^2) + eps) in fp32, rounded once (fla's
  convention, `gated_delta.reference.l2norm`). Ours rather than fla's in-kernel one: fla autotunes its l2norm
  over 25 configs per bucket of T * H / 65,536, so the first prefill of each new size bucket compiles (docs/bench.md,
  "Start-up compiles").

Inputs may be head views: a [T, H, D] tensor whose rows sit at t * stride_t + h * stride_h (q / k / z sliced out
of a fused projection, q / k / v out of the conv output) is read in place, never copied first. Row r of the
output (contiguous [T * H, D]) is (t, h) = divmod(r, H)::

    x = qkv[:, :1024].view(T, 8, 128)      stride_t = 3072 (the fused row), stride_h = 128, heads = 8
    row r -> x_ptr + (r // 8) * 3072 + (r % 8) * 128 + [0, 128)
No autotuning, so nothing compiles at run time beyond Triton's integer specialisations, which the engine's warm-up
reaches.

`add_rms_norm_fp8` and `gated_rms_norm_fp8` are those norms with the FP8 quantisation of their output for the FP8
linear after them in the same launch: the output as it is stored (rounded to its dtype) quantised per token per
group of channels exactly as `gemm.triton_quant.quantize_groups(out, group, pad_rows=..., column_major=True)`
(the same amax, clamp, IEEE division and e4m3 rounding), a token being a row of the output flattened to
[T, heads * dim] (a group never straddles two rows of the norm: heads == 1 or dim % group == 0). Programs past the
last token write the padding tokens (zeros, scale 1e-12 / 448) and nothing else.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.fp8_format import FP8_DTYPE, FP8_MAX
from hybridcache.kernels import pdl
from hybridcache.kernels.norm import reference


@triton.jit
def _load_rows(x_ptr, rows, stride_t, stride_h, heads, cols, ok):  # rows `rows` of a [T, H, D] view, in fp32
    starts = (rows // heads) * stride_t + (rows % heads) * stride_h
    return tl.load(x_ptr + starts[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _block(num_rows, dim, ROWS: tl.constexpr, BLOCK: tl.constexpr):  # this program's rows, columns and mask
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    return rows, cols, (rows < num_rows)[:, None] & (cols < dim)[None, :]


# Every kernel: one program per ROWS rows; (x_ptr, out_ptr, num_rows, stride_t, stride_h, heads, dim, eps) first,
# then its own. num_rows is not specialised on (a 1-row call must not compile another variant).
@triton.jit
def _gated_norm(x_ptr, g_ptr, w_ptr, rows, cols, ok, stride_t, stride_h, gate_stride_t, gate_stride_h, heads, dim, eps,
                dtype: tl.constexpr):
    """The rows' gated RMSNorm in `dtype`, rounded as `layers.norm.GatedRMSNorm` rounds: the norm, then its product
    with w, each rounded to `dtype`, then the product with silu(gate)."""
    x = _load_rows(x_ptr, rows, stride_t, stride_h, heads, cols, ok)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / dim + eps)
    normed = (x * rstd[:, None]).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    scaled = (w[None, :] * normed).to(dtype).to(tl.float32)
    gate = _load_rows(g_ptr, rows, gate_stride_t, gate_stride_h, heads, cols, ok)
    return (scaled * (gate * tl.sigmoid(gate))).to(dtype)


@triton.jit
def _weighted(x, w_ptr, cols, dim, eps, dtype: tl.constexpr, WEIGHTING: tl.constexpr):
    """The rows x [ROWS, BLOCK] (fp32) normalised and weighted as `reference.rms_norm` does for WEIGHTING (a
    `Weighting` value), in `dtype`."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / dim + eps)
    w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    normed = x * rstd[:, None]
    if WEIGHTING == 0:  # zero-centred: n * (1 + w), rounded once
        y = normed * (1.0 + w[None, :])
    elif WEIGHTING == 1:  # w * round(n), rounded (the product in w's dtype, which is x's here)
        y = w[None, :] * normed.to(dtype).to(tl.float32)
    else:  # w * n in fp32, rounded once
        y = w[None, :] * normed
    return y.to(dtype)


@triton.jit
def _add_and_norm(x_ptr, r_ptr, sum_ptr, w_ptr, rows, cols, ok, stride_t, stride_h, r_stride_t, r_stride_h, heads,
                  dim, eps, dtype: tl.constexpr, WEIGHTING: tl.constexpr, scale, SCALED: tl.constexpr):
    """The rows' x + residual (SCALED: x + residual * scale, the product rounded to the sum's dtype first, as torch's
    `residual * scale` is), stored at sum_ptr in its dtype, and the RMSNorm of that stored sum (`_weighted`) in
    `dtype`: returns (the rows' offsets in a contiguous [rows, dim] output, the norm)."""
    x = _load_rows(x_ptr, rows, stride_t, stride_h, heads, cols, ok)
    r = _load_rows(r_ptr, rows, r_stride_t, r_stride_h, heads, cols, ok)
    if SCALED:
        r = (r * scale).to(sum_ptr.dtype.element_ty).to(tl.float32)
    dest = rows[:, None] * dim + cols[None, :]
    total = (x + r).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + dest, total, mask=ok)
    return dest, _weighted(total.to(tl.float32), w_ptr, cols, dim, eps, dtype, WEIGHTING)


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(x_ptr, out_ptr, num_rows, stride_t, stride_h, heads, dim, eps, w_ptr, WEIGHTING: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    rows, cols, ok = _block(num_rows, dim, ROWS, BLOCK)
    x = _load_rows(x_ptr, rows, stride_t, stride_h, heads, cols, ok)
    y = _weighted(x, w_ptr, cols, dim, eps, out_ptr.dtype.element_ty, WEIGHTING)
    tl.store(out_ptr + rows[:, None] * dim + cols[None, :], y, mask=ok)


@triton.jit(do_not_specialize=["num_rows"])
def _add_rms_norm_kernel(x_ptr, out_ptr, num_rows, stride_t, stride_h, heads, dim, eps, r_ptr, r_stride_t,
                         r_stride_h, sum_ptr, w_ptr, scale, WEIGHTING: tl.constexpr, SCALED: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    rows, cols, ok = _block(num_rows, dim, ROWS, BLOCK)
    dest, y = _add_and_norm(x_ptr, r_ptr, sum_ptr, w_ptr, rows, cols, ok, stride_t, stride_h, r_stride_t,
                            r_stride_h, heads, dim, eps, out_ptr.dtype.element_ty, WEIGHTING, scale, SCALED)
    tl.store(out_ptr + dest, y, mask=ok)


@triton.jit(do_not_specialize=["num_rows"])
def _gated_rms_norm_kernel(x_ptr, out_ptr, num_rows, stride_t, stride_h, heads, dim, eps, g_ptr, gate_stride_t,
                           gate_stride_h, w_ptr, ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    rows, cols, ok = _block(num_rows, dim, ROWS, BLOCK)
    y = _gated_norm(x_ptr, g_ptr, w_ptr, rows, cols, ok, stride_t, stride_h, gate_stride_t, gate_stride_h, heads, dim,
                    eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * dim + cols[None, :], y, mask=ok)


@triton.jit(do_not_specialize=["num_rows"])
def _gated_group_norm_kernel(x_ptr, out_ptr, num_rows, stride_t, stride_h, heads, dim, eps, g_ptr, gate_stride_t,
                             gate_stride_h, w_ptr, NORM_BEFORE_GATE: tl.constexpr, ROWS: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Mamba2's gated RMSNorm per group (`mamba2.reference.gated_group_rms_norm`): row r is group r % heads of token
    r // heads (heads: the groups, dim: the group size, the weight [heads * dim]); fp32 throughout, rounded once."""
    pdl.start(PDL)
    rows, cols, ok = _block(num_rows, dim, ROWS, BLOCK)
    x = _load_rows(x_ptr, rows, stride_t, stride_h, heads, cols, ok)
    gate = _load_rows(g_ptr, rows, gate_stride_t, gate_stride_h, heads, cols, ok)
    silu = gate * tl.sigmoid(gate)
    if not NORM_BEFORE_GATE:
        x = x * silu
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / dim + eps)
    w = tl.load(w_ptr + (rows % heads)[:, None] * dim + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    y = w * (x * rstd[:, None])
    if NORM_BEFORE_GATE:
        y = y * silu
    tl.store(out_ptr + rows[:, None] * dim + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["num_rows"])
def _l2norm_kernel(x_ptr, out_ptr, num_rows, stride_t, stride_h, heads, dim, eps, ROWS: tl.constexpr,
                   BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    rows, cols, ok = _block(num_rows, dim, ROWS, BLOCK)
    x = _load_rows(x_ptr, rows, stride_t, stride_h, heads, cols, ok)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps)
    tl.store(out_ptr + rows[:, None] * dim + cols[None, :], (x * rstd[:, None]).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _store_fp8_groups(y, rows, cols, padded_rows, heads, dim, q_ptr, s_ptr, stride_q, stride_sm, stride_sg,
                      ROWS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, QMAX: tl.constexpr):
    """Quantise the tile y [ROWS, BLOCK] (fp32 holding the stored output's values; +0 past dim and in the padding
    tokens, where the norm's arithmetic may give -0) per GROUP columns: row r = token t * heads + h writes
    q[t, h * dim + c] and one scale per group, at s_ptr + t * stride_sm + group * stride_sg (`quantize_groups`'
    arithmetic)."""
    groups = tl.reshape(y, (ROWS, BLOCK // GROUP, GROUP))
    scale = tl.maximum(tl.max(tl.abs(groups), axis=2), 1e-12) / QMAX
    q = tl.clamp(tl.math.div_rn(groups, scale[:, :, None]), -QMAX, QMAX)
    q = tl.reshape(q, (ROWS, BLOCK))
    token = rows // heads
    first = (rows % heads) * dim  # the row's first column in its token's flattened row
    row_ok = rows < padded_rows
    dest = q_ptr + token[:, None] * stride_q + first[:, None] + cols[None, :]
    tl.store(dest, q.to(q_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < dim)[None, :])
    group = tl.arange(0, BLOCK // GROUP)
    scales = s_ptr + token[:, None] * stride_sm + (first[:, None] // GROUP + group[None, :]) * stride_sg
    tl.store(scales, scale, mask=row_ok[:, None] & (group * GROUP < dim)[None, :])


@triton.jit(do_not_specialize=["num_rows", "padded_rows", "stride_sg"])
def _add_rms_norm_fp8_kernel(x_ptr, out_ptr, num_rows, stride_t, stride_h, heads, dim, eps, r_ptr, r_stride_t,
                             r_stride_h, sum_ptr, w_ptr, padded_rows, q_ptr, s_ptr, stride_q, stride_sm, stride_sg,
                             ROWS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, QMAX: tl.constexpr,
                             PDL: tl.constexpr):
    pdl.start(PDL)
    rows, cols, ok = _block(num_rows, dim, ROWS, BLOCK)
    dest, y = _add_and_norm(x_ptr, r_ptr, sum_ptr, w_ptr, rows, cols, ok, stride_t, stride_h, r_stride_t,
                            r_stride_h, heads, dim, eps, out_ptr.dtype.element_ty, 0, 1.0, False)  # (Qwen's)
    tl.store(out_ptr + dest, y, mask=ok)
    _store_fp8_groups(tl.where(ok, y.to(tl.float32), 0.0), rows, cols, padded_rows, heads, dim, q_ptr, s_ptr,
                      stride_q, stride_sm, stride_sg, ROWS, BLOCK, GROUP, QMAX)


@triton.jit(do_not_specialize=["num_rows", "padded_rows", "stride_sg"])
def _gated_rms_norm_fp8_kernel(x_ptr, out_ptr, num_rows, stride_t, stride_h, heads, dim, eps, g_ptr, gate_stride_t,
                               gate_stride_h, w_ptr, padded_rows, q_ptr, s_ptr, stride_q, stride_sm, stride_sg,
                               ROWS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, QMAX: tl.constexpr,
                               PDL: tl.constexpr):
    pdl.start(PDL)
    rows, cols, ok = _block(num_rows, dim, ROWS, BLOCK)
    y = _gated_norm(x_ptr, g_ptr, w_ptr, rows, cols, ok, stride_t, stride_h, gate_stride_t, gate_stride_h, heads, dim,
                    eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * dim + cols[None, :], y, mask=ok)
    _store_fp8_groups(tl.where(ok, y.to(tl.float32), 0.0), rows, cols, padded_rows, heads, dim, q_ptr, s_ptr,
                      stride_q, stride_sm, stride_sg, ROWS, BLOCK, GROUP, QMAX)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x [..., dim] as (tensor, stride_t, stride_h, heads): row r at (r // heads) * stride_t + (r % heads) *
    stride_h with unit-stride columns. 2-D inputs and 3-D head views are read in place; other layouts are
    reshaped (copied when they must be)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        return x, x.stride(0), x.stride(1), x.shape[1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat, flat.stride(0), 0, 1


_ELEMENTS_PER_PROGRAM = 2048  # rows per program = this // the padded row width (1 for rows of >= 2,048)


def _num_warps(rows_per_program: int, block: int) -> int:
    """Warps of a program: 4 for grouped short rows; a hidden-size row alone gets one warp per 256 columns, up to
    16 (64 x 4,096 add_rms_norm: 2.25 us against 2.67 with 4 warps; 64 x 2,048: 1.96 against 2.11; docs/bench.md,
    issue 32's sixth pass)."""
    return 4 if rows_per_program > 1 else max(4, min(16, block // 256))


def _launch(kernel, x: torch.Tensor, eps: float, fp_fusion: bool, *extra) -> torch.Tensor:
    """A contiguous [..., dim] output in x's dtype, ROWS rows of x per program (read in place, `_rows`); `fp_fusion`
    False compiles the kernel without contracting a product and a sum into one FMA (one rounding where torch's two
    ops round twice).

    Rows of a head dim (128) are 256 bytes: one program each leaves long prefill steps latency-bound (docs/bench.md,
    "Figures behind the code's choices"), so short rows are grouped, 16 per program at 128 columns; hidden-size
    rows (2,048+) keep one program each, with more warps (`_num_warps`)."""
    rows, stride_t, stride_h, heads = _rows(x)
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = out.numel() // dim if dim else 0
    if num_rows:
        block = triton.next_power_of_2(dim)
        per_program = max(1, _ELEMENTS_PER_PROGRAM // block)
        kernel[(triton.cdiv(num_rows, per_program),)](rows, out, num_rows, stride_t, stride_h, heads, dim, eps,
                                                      *extra, ROWS=per_program, BLOCK=block,
                                                      num_warps=_num_warps(per_program, block),
                                                      enable_fp_fusion=fp_fusion, **pdl.options(x))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             weighting: reference.Weighting = reference.Weighting.ZERO_CENTRED) -> torch.Tensor:
    """RMSNorm over the last dim, weighted as `weighting` says: x [..., dim], weight [dim] -> contiguous [..., dim] in
    x's dtype. ROUNDED with a weight of another dtype (its product with the rounded norm takes the wider one) runs
    the torch reference."""
    if weighting == reference.Weighting.ROUNDED and weight.dtype != x.dtype:
        return reference.rms_norm(x, weight, eps, weighting)
    return _launch(_rms_norm_kernel, x, eps, True, weight, int(weighting))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    weighting: reference.Weighting = reference.Weighting.ZERO_CENTRED, scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., dim] (same shape and dtype), weight [dim] -> (s, rms_norm(s)), s = x + residual * scale
    (`reference.add_rms_norm`'s roundings), both contiguous [..., dim] in x's dtype (module docstring; `rms_norm` for
    `weighting`)."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} and x {tuple(x.shape)} "
                         f"{x.dtype} differ")
    if weighting == reference.Weighting.ROUNDED and weight.dtype != x.dtype:
        return reference.add_rms_norm(x, residual, weight, eps, weighting, scale)
    residuals, r_stride_t, r_stride_h, _ = _rows(residual)  # same shape, so the same row -> (t, h) split
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # scaled: x + residual * scale as torch's two ops (fp32: with fusion the GPU would contract them into one FMA)
    return total, _launch(_add_rms_norm_kernel, x, eps, scale == 1.0, residuals, r_stride_t, r_stride_h, total, weight,
                          scale, int(weighting), scale != 1.0)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm over the last dim: x, gate [..., dim] (same shape), weight [dim] -> contiguous [..., dim]."""
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate {tuple(gate.shape)} and x {tuple(x.shape)} differ")
    gates, gate_stride_t, gate_stride_h, _ = _rows(gate)  # same shape, so the same row -> (t, h) split
    return _launch(_gated_rms_norm_kernel, x, eps, True, gates, gate_stride_t, gate_stride_h, weight)


def gated_group_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                         norm_before_gate: bool = False) -> torch.Tensor:
    """Mamba2's gated RMSNorm over groups of `group_size` channels in one launch: x, gate [T, I] (any row strides,
    unit channel stride: gate is a column view of in_proj's output), weight [I] -> contiguous [T, I] in gate's
    dtype, `mamba2.reference.gated_group_rms_norm`'s math (fp32, rounded once)."""
    if x.dim() != 2 or gate.shape != x.shape or x.shape[-1] % group_size or tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"gated_group_rms_norm: x and gate [T, I] with I a multiple of group_size {group_size} and "
                         f"weight [I] needed, got {list(x.shape)}, {list(gate.shape)}, {list(weight.shape)}")
    tokens, width = x.shape
    groups = width // group_size
    xs, stride_t, stride_h, _ = _rows(x.unflatten(-1, (groups, group_size)))
    gates, gate_stride_t, gate_stride_h, _ = _rows(gate.unflatten(-1, (groups, group_size)))
    out = torch.empty((tokens, width), dtype=gate.dtype, device=x.device)
    num_rows = tokens * groups
    if num_rows:
        block = triton.next_power_of_2(group_size)
        per_program = max(1, _ELEMENTS_PER_PROGRAM // block)
        _gated_group_norm_kernel[(triton.cdiv(num_rows, per_program),)](
            xs, out, num_rows, stride_t, stride_h, groups, group_size, eps, gates, gate_stride_t, gate_stride_h,
            weight, norm_before_gate, ROWS=per_program, BLOCK=block, num_warps=_num_warps(per_program, block),
            **pdl.options(x))
    return out


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: x [..., dim] -> contiguous [..., dim] in x's dtype."""
    return _launch(_l2norm_kernel, x, eps, True)


def _launch_fp8(kernel, x: torch.Tensor, eps: float, group: int, pad_rows: int, *extra
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_launch` for the FP8 kernels: (out [..., dim] in x's dtype, q [T', heads * dim] float8_e4m3fn, scale
    [T', ceil(heads * dim / group)] fp32 stored column-major (stride (1, T'))), T' = the tokens T (x [T, dim] or
    [T, heads, dim]) rounded up to a multiple of `pad_rows`. Every program is launched over T' tokens' rows."""
    if x.dim() not in (2, 3):
        raise ValueError(f"FP8 norm: x [T, dim] or [T, heads, dim] needed, got {list(x.shape)}")
    if group < 16 or group & (group - 1) or pad_rows < 1:
        raise ValueError(f"FP8 norm: a power-of-two group >= 16 and pad_rows >= 1 needed, got {group}, {pad_rows}")
    rows, stride_t, stride_h, heads = _rows(x)
    tokens, dim = x.shape[0], x.shape[-1]
    if heads > 1 and dim % group:
        raise ValueError(f"FP8 norm: rows of {dim} channels in {heads} heads would cut a group of {group}")
    padded = -(-tokens // pad_rows) * pad_rows
    width = heads * dim
    num_groups = -(-width // group)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    q = torch.empty((padded, width), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((num_groups, padded), dtype=torch.float32, device=x.device).t()
    if padded and dim:
        block = max(group, triton.next_power_of_2(dim))
        per_program = max(1, _ELEMENTS_PER_PROGRAM // block)
        kernel[(triton.cdiv(padded * heads, per_program),)](
            rows, out, tokens * heads, stride_t, stride_h, heads, dim, eps, *extra, padded * heads, q, scale,
            q.stride(0), scale.stride(0), scale.stride(1), ROWS=per_program, BLOCK=block, GROUP=group, QMAX=FP8_MAX,
            num_warps=_num_warps(per_program, block), **pdl.options(x))
    return out, q, scale


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int = 128,
                     pad_rows: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_rms_norm` and the FP8 quantisation of its norm for the FP8 linear after it, in one launch: x, residual
    [T, dim] -> (x + residual, normed, q, scale), q and scale equal to `triton_quant.quantize_groups(normed, group,
    pad_rows=pad_rows, column_major=True)` (module docstring)."""
    if residual.shape != x.shape or residual.dtype != x.dtype or x.dim() != 2:
        raise ValueError(f"add_rms_norm_fp8: residual {tuple(residual.shape)} {residual.dtype} and x "
                         f"{tuple(x.shape)} {x.dtype}: one [T, dim] shape and dtype needed")
    residuals, r_stride_t, r_stride_h, _ = _rows(residual)
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    normed, q, scale = _launch_fp8(_add_rms_norm_fp8_kernel, x, eps, group, pad_rows, residuals, r_stride_t,
                                   r_stride_h, total, weight)
    return total, normed, q, scale


def gated_rms_norm_fp8(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group: int = 128,
                       pad_rows: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gated_rms_norm` and the FP8 quantisation of its output, flattened to [T, heads * dim], in one launch: x,
    gate [T, heads, dim] or [T, dim] -> (out, q, scale), q and scale equal to `triton_quant.quantize_groups(
    out.reshape(T, -1), group, pad_rows=pad_rows, column_major=True)`; dim % group == 0 where heads > 1."""
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm_fp8: gate {tuple(gate.shape)} and x {tuple(x.shape)} differ")
    gates, gate_stride_t, gate_stride_h, _ = _rows(gate)
    return _launch_fp8(_gated_rms_norm_fp8_kernel, x, eps, group, pad_rows, gates, gate_stride_t, gate_stride_h,
                       weight)
