"""The skinny dense GEMM in Triton: out = x W^T (+ bias) for few rows (a decode step's M <= 64), streaming the
weight once, with split-K reduced inside the same launch.

    x [M, K] (bf16 / fp16 / fp32), W [N, K] in x's dtype, bias [N] or None  ->  out [M, N] in x's dtype

The grid is (N tiles of BLOCK_N, SPLIT slices of K: a compile-time constant, one compile per count). Each program
multiplies its weight tile [BLOCK_N, k slice] by the rows (swap-AB: the MMA computes out^T = W x^T, so the weight
tile is the MMA's M side, where Hopper's wgmma wants 64 rows, and the few rows of x its N side, BLOCK_M = 16 to 64),
accumulating in fp32.

- SWIGLU: x's tiles are silu(gate) * up of two inputs (an MLP's down projection; `skinny_linear(..., up=)`).
- TMA (`SkinnyConfig.tma`): the weight's tiles (and x's, but with SWIGLU) come by Hopper's tensor-memory copies
  through descriptors made per launch on the host (rows and columns past a tensor's edge read as 0), instead of
  pointer loads; the weight and x need 16-byte aligned rows (an unaligned x is copied first).
- One slice (`SkinnyConfig.split_k == 1`): the program adds the bias and stores its tile rounded to x's dtype.
- Several: every program stores its fp32 partial tile in a workspace, then increments its N tile's counter
  (an atomic with acquire-release order, after a barrier of the program's threads). The program that finds every
  other slice already counted sums the partial tiles in slice order 0, 1, ... (so the result does not depend on
  which program arrives last: the same inputs give the same bits; the loop over slices is unrolled, so all their
  loads are in flight together), adds the bias, stores the tile and sets the
  counter back to 0 for the next launch. No second launch reduces the slices (cuBLAS's split-K GEMMs run one).
Contract of the workspace and counters (`Scratch`): one per device, shared by every launch; launches on one stream
run one after another, so they never overlap. A launch leaves every counter at 0. Do not launch this kernel on
two streams of one device at once.

The weight is read through unmasked K steps when K is a multiple of BLOCK_K (EVEN_K, the models' case: pipelined
16-byte copies); M, N, K and the slice length (in K steps, so every slice starts aligned) are run-time integers
(`do_not_specialize`: one compile per tile shape and split count, whatever the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

MAX_ROWS = 64  # the most rows one launch takes (BLOCK_M)
WORKSPACE_FLOATS = 1 << 22  # fp32 partial tiles per device (16 MiB): split_k * N tiles * BLOCK_N * BLOCK_M at most
MAX_TILES = 1 << 14  # counters per device: N tiles of one launch at most


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration of `_skinny_gemm_kernel` (Triton compiles one kernel per tile shape)."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = False  # the weight's (and x's) tiles by TMA copies through descriptors (`_tma_loop`)

    def describe(self) -> str:
        return (f"skinny{' tma' if self.tma else ''} n{self.block_n} k{self.block_k} s{self.split_k} "
                f"w{self.num_warps} st{self.num_stages}")


def block_rows(m: int) -> int:
    """BLOCK_M of a launch of m rows: 16, 32 or 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


@dataclass
class Scratch:
    """The device's split-K workspace (fp32) and per-tile counters (int32, all 0 between launches)."""

    workspace: torch.Tensor
    counters: torch.Tensor


_SCRATCH: dict[torch.device, Scratch] = {}


def scratch(device: torch.device) -> Scratch:
    """The device's `Scratch`, allocated on first use (never while a CUDA graph is being captured: call
    `skinny_linear` once eagerly first)."""
    found = _SCRATCH.get(device)
    if found is None:
        found = _SCRATCH[device] = Scratch(torch.empty(WORKSPACE_FLOATS, dtype=torch.float32, device=device),
                                           torch.zeros(MAX_TILES, dtype=torch.int32, device=device))
    return found


def fits(n: int, k: int, m: int, config: SkinnyConfig) -> bool:
    """Whether `config` can run this shape: its workspace fits, its counters suffice, and every slice but the
    last holds whole K steps and no slice is empty."""
    tiles = triton.cdiv(n, config.block_n)
    slice_k = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    return (m <= MAX_ROWS and tiles <= MAX_TILES and (config.split_k - 1) * slice_k < k
            and (config.split_k == 1 or config.split_k * tiles * config.block_n * block_rows(m) <= WORKSPACE_FLOATS))


@triton.jit
def _store_out(out_ptr, bias_ptr, acc, rows, cols, row_ok, col_ok, stride_om, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] fp32 (+ bias[cols]) rounded to out's dtype at out[rows, cols]."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + rows[None, :] * stride_om + cols[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])


@triton.jit
def _load_rows(x_ptrs, up_ptrs, mask, SWIGLU: tl.constexpr):
    """An x tile; with SWIGLU, silu(gate) * up from the gate tile at x_ptrs and the up tile at up_ptrs, rounded
    where `activation.silu_mul` rounds (the same values it would have written)."""
    if SWIGLU:
        dtype = x_ptrs.dtype.element_ty
        g = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptrs, mask=mask, other=0.0).to(tl.float32)
        x = ((g * tl.sigmoid(g)).to(dtype).to(tl.float32) * u).to(dtype)
    else:
        x = tl.load(x_ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def _pointer_loop(x_ptr, up_ptr, w_ptr, k_start, steps, rows64, cols64, row_ok, col_ok, K, stride_xm, stride_um,
                  stride_wn, EVEN_K: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] = W[cols, slice] x[rows, slice]^T over `steps` K steps from k_start, both tiles by
    pointer loads (pipelined `cp.async` on sm90)."""
    x_ptrs = x_ptr + rows64[:, None] * stride_xm + (k_start + tl.arange(0, BLOCK_K))[None, :]
    up_ptrs = up_ptr + rows64[:, None] * stride_um + (k_start + tl.arange(0, BLOCK_K))[None, :]
    w_ptrs = w_ptr + cols64[:, None] * stride_wn + (k_start + tl.arange(0, BLOCK_K))[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in range(0, steps):
        if EVEN_K:
            x = _load_rows(x_ptrs, up_ptrs, row_ok[:, None], SWIGLU)
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = k_start + i * BLOCK_K + tl.arange(0, BLOCK_K) < K
            x = _load_rows(x_ptrs, up_ptrs, row_ok[:, None] & k_ok[None, :], SWIGLU)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.float32, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _tma_loop(x_desc, up_ptr, w_desc, k_start, steps, rows64, row_ok, K, stride_xm, stride_um, pid_n,
              SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PRECISION: tl.constexpr):
    """`_pointer_loop` with the weight tile (and x's, unless SWIGLU) read by tensor-memory-accelerator copies
    through descriptors (rows and columns past the tensor's edges read as 0); with SWIGLU x_desc is the gate's
    pointer and x's tiles are pointer loads."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in range(0, steps):
        k = k_start + i * BLOCK_K
        w = w_desc.load([pid_n * BLOCK_N, k])
        if SWIGLU:
            ks = k + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (ks < K)[None, :]
            x = _load_rows(x_desc + rows64[:, None] * stride_xm + ks[None, :],
                           up_ptr + rows64[:, None] * stride_um + ks[None, :], mask, SWIGLU)
        else:
            x = x_desc.load([0, k])
        acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.float32, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["M", "N", "K", "slice_steps"])
def _skinny_gemm_kernel(x_ptr, up_ptr, w_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, slice_steps,
                        stride_xm, stride_um, stride_wn, stride_om,
                        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, SWIGLU: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr, TMA: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    k_start = pid_k * slice_steps * BLOCK_K  # a multiple of BLOCK_K: aligned, vectorised loads
    steps = tl.minimum(slice_steps, tl.cdiv(K - k_start, BLOCK_K))
    if TMA:
        acc = _tma_loop(x_ptr, up_ptr, w_ptr, k_start, steps, rows64, row_ok, K, stride_xm, stride_um, pid_n,
                        SWIGLU, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    else:
        acc = _pointer_loop(x_ptr, up_ptr, w_ptr, k_start, steps, rows64, cols64, row_ok, col_ok, K, stride_xm,
                            stride_um, stride_wn, EVEN_K, SWIGLU, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    if SPLIT > 1:
        tiles_n = tl.num_programs(0)
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        size = BLOCK_N * BLOCK_M
        tl.store(ws_ptr + (pid_k * tiles_n + pid_n).to(tl.int64) * size + tile, acc)
        tl.debug_barrier()  # every thread's partial stored before the counter says so
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:  # the last slice of this N tile: reduce in slice order
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT):  # unrolled: every slice's loads in flight at once
                total += tl.load(ws_ptr + (s * tiles_n + pid_n).to(tl.int64) * size + tile, cache_modifier=".cg")
            _store_out(out_ptr, bias_ptr, total, rows64, cols64, row_ok, col_ok, stride_om, HAS_BIAS)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        _store_out(out_ptr, bias_ptr, acc, rows64, cols64, row_ok, col_ok, stride_om, HAS_BIAS)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig,
                  out: torch.Tensor | None = None, up: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] with M <= `MAX_ROWS` and unit stride on K, weight [N, K] (unit stride on K) and bias [N] in x's
    dtype -> x W^T (+ bias) [M, N] in x's dtype (into `out` when given, [M, N] with unit column stride). With `up`
    ([M, K] in x's dtype, unit stride on K): x is the gate and the product's input silu(x) * up, made as the
    tiles are loaded (`activation.silu_mul`'s values: the same result as that launch followed by this one).
    Shapes, dtypes and strides are checked before the launch (ValueError); `fits(N, K, M, config)` must hold."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"skinny_linear: x [M, K] and weight [N, K] needed, got {list(x.shape)} and "
                         f"{list(weight.shape)}")
    if up is not None and (up.shape != x.shape or up.dtype != x.dtype or up.stride(1) != 1):
        raise ValueError(f"skinny_linear: up {list(x.shape)} {x.dtype} with unit stride on K needed, got "
                         f"{list(up.shape)} {up.dtype}")
    (m, k), n = x.shape, weight.shape[0]
    if weight.dtype != x.dtype or (bias is not None and (bias.dtype != x.dtype or tuple(bias.shape) != (n,))):
        raise ValueError(f"skinny_linear: weight and bias [N] in x's dtype {x.dtype} needed, got weight "
                         f"{weight.dtype}" + ("" if bias is None else f", bias {list(bias.shape)} {bias.dtype}"))
    if x.stride(1) != 1 or weight.stride(1) != 1 or (bias is not None and bias.stride(0) != 1):
        raise ValueError("skinny_linear needs unit stride on K (x and weight) and a contiguous bias")
    if not fits(n, k, m, config):
        raise ValueError(f"skinny_linear: {config.describe()} cannot run M={m}, N={n}, K={k}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"skinny_linear: out [{m}, {n}] {x.dtype} with unit column stride needed")
    if m == 0 or n == 0:
        return out
    block_k = min(config.block_k, 32) if x.dtype == torch.float32 else config.block_k  # fp32 tiles: 2x the bytes
    slice_k = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    room = scratch(x.device)
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    x_arg, w_arg = x, weight
    if config.tma:
        if not tma_ready(weight):
            raise ValueError("skinny_linear: a TMA launch needs a 16-byte aligned weight with 16-byte aligned rows")
        if up is None:
            if not tma_ready(x):
                x = x.clone()  # a fresh allocation: aligned base and rows (k * itemsize % 16 == 0 by the weight's)
            x_arg = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_rows(m), block_k])
        w_arg = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [config.block_n, block_k])
    args = (x_arg, x if up is None else up, w_arg, bias if bias is not None else x, out, room.workspace,
            room.counters, m, n, k)
    strides = (x.stride(0), x.stride(0) if up is None else up.stride(0), weight.stride(0), out.stride(0))
    meta = dict(HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, SWIGLU=up is not None, BLOCK_M=block_rows(m),
                BLOCK_N=config.block_n, BLOCK_K=block_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                TMA=config.tma, num_warps=config.num_warps, num_stages=config.num_stages)
    _skinny_gemm_kernel[grid](*args, slice_k // block_k, *strides, SPLIT=config.split_k, **meta)
    return out


def tma_ready(t: torch.Tensor) -> bool:
    """Whether a 2-D tensor can back a TMA descriptor: unit stride on its last dim, a 16-byte aligned base and row
    stride."""
    size = t.element_size()
    return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0
