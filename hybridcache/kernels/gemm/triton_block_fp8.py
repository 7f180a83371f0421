"""The FP8-weight GEMM in Triton: out = x W^T with W an FP8 weight [N, K] scaled per (GROUP_N x GROUP_K) block,
in one of two modes, and `fp8_linear`, the dense FP8 linear of the CUDA backend (cuBLAS's block-scaled GEMM where
it applies, else this kernel):

- **W8A8**: x quantised per token per GROUP_K channels (`triton_quant.quantize_groups`, one launch), then the
  DeepSeek-V3 recipe on FP8 tensor cores, one activation scale per row and K step:
      out[m, n] = sum over K steps b of (xq[m, b] . w[n, b]) * x_scale[m, b // GROUP_K] * w_scale[n // GROUP_N, ...]
- **W8A16**: x in its own dtype (bf16/fp16/fp32), each weight tile converted to x's dtype in registers (exact:
  every e4m3 value is a bf16 value) and each K step's product scaled per column:
      out[m, n] = sum over K steps b of (x[m, b] . w[n, b]) * w_scale[n // GROUP_N, b // GROUP_K]
  No quantisation launch, but the conversion costs more than it saves on the H200 (docs/kernels.md), so
  `fp8_linear` takes it only with `DECODE_W8A16`.

One kernel does both (constexpr A_FP8). SWAP_AB computes out^T = W x^T: the weight tile is the MMA's M side
(Hopper's wgmma takes 64 rows there) and the few rows of a decode step its N side (16 to 64). Per-channel weights
(`weight_scale` [N, 1]) are the case GROUP_N = 1 with a K stride of 0 on the scale. BLOCK_K divides GROUP_K, so a
K step never straddles two scale groups. The grid is one dimension over output tiles, GROUP_M tile rows at a
time (L2 reuse of weight tiles across rows of tiles). Rows and columns past M, N and channels past K are masked
to zero (any M, N, K; partial blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridcache.fp8_format import FP8_DTYPE, Fp8Format
from hybridcache.kernels.gemm import triton_quant

# `fp8_linear`'s choices (measured on the H200: `benchmarks/fp8_sweep.py`, docs/kernels.md "Quantization")
CUBLAS_ROWS_FROM = 1  # from this many rows, cuBLAS's block-scaled GEMM where it applies (`block_scaled_mm_fits`)
DECODE_ROWS = 64  # otherwise, up to this many rows: this kernel with the decode tiles (`decode_config`)
DECODE_W8A16 = False  # the decode tiles in W8A16 (no quantisation launch), else W8A8
DECODE_SWAP_AB = True  # decode tiles: the weight tile on the MMA's M side
# (N, K) of a weight -> up to how many rows `fp8_linear` runs this kernel's W8A8 decode tile on it instead of
# cuBLAS: the shapes where `benchmarks/fp8_sweep.py --rowwise` measured the swap-AB tile faster at decode sizes
# (cuBLASLt runs one 128 x 128 kernel for every block-scaled shape; docs/bench.md, "FP8 on the H200")
# (`fp8_sweep.py --rowwise`, next-16b's projections: the Triton tile wins at 16 rows on every shape, at 64 on the
# shared expert's down projection alone)
DECODE_TRITON_SHAPES: dict[tuple[int, int], int] = {
    (12288, 4096): 16, (8192, 4096): 16, (4096, 4096): 16, (2048, 4096): 16, (1024, 4096): 16, (512, 4096): 16,
    (4096, 1024): 64}
# (N, K) of a weight -> the split-K W8A8 decode tile (`SplitK`) `fp8_linear` runs on it from its `min_rows` up to
# `DECODE_ROWS` rows, set by hand or from a sweep (`benchmarks/fp8_sweep.py --splitk`, then `fp8_bench.py
# --decode-kernels-from`); other shapes: `fp8_decode_choice` measures on the device
DECODE_SPLIT_K: dict[tuple[int, int], SplitK] = {}


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration of `_fp8_gemm_kernel` (Triton compiles one kernel per configuration)."""

    block_m: int
    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    group_m: int = 8
    swap_ab: bool = False  # the MMA computes out^T = W x^T (the weight tile on the MMA's M side)


def decode_config(m: int) -> TileConfig:
    """The tile of a decode GEMM of M <= `DECODE_ROWS` rows: swap-AB (64 weight rows on the MMA's M side, the
    rows as its N side, 16 to 64). Decided from M alone, so a captured decode graph and an eager run agree."""
    return TileConfig(16 if m <= 16 else 32 if m <= 32 else 64, 64, swap_ab=DECODE_SWAP_AB)


PREFILL_TILE = TileConfig(64, 128)  # W8A8 where `scaled_mm.block_fp8_linear` does not apply


@dataclass(frozen=True)
class SplitK:
    """A split-K launch of the W8A8 swap-AB decode GEMM (`fp8_gemm_splitk`): `block_n` weight rows a program,
    the K steps cut into `split_k` parts, one program each (`split_k` programs per `block_n` output columns
    instead of one: a decode GEMM's few output tiles then keep more SMs reading weights)."""

    block_n: int = 64
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 4
    min_rows: int = 1  # `fp8_linear` takes it from this many rows (up to `DECODE_ROWS`)


@triton.jit
def scaled_dot(a, w, a_scale, w_scale, SWAP_AB: tl.constexpr, PRECISION: tl.constexpr):
    """One K step: (a [BM, BK] . w [BN, BK]^T) * a_scale[m] * w_scale[n] as [BM, BN] in fp32, or its transpose
    [BN, BM] with SWAP_AB (computed as w . a^T: the weight tile on the MMA's M side)."""
    if SWAP_AB:  # one return statement: Triton wants one return type over both (constexpr) branches
        part = tl.dot(w, tl.trans(a), out_dtype=tl.float32, input_precision=PRECISION) * (
            w_scale[:, None] * a_scale[None, :])
    else:
        part = tl.dot(a, tl.trans(w), out_dtype=tl.float32, input_precision=PRECISION) * (
            a_scale[:, None] * w_scale[None, :])
    return part


@triton.jit
def store_tile(out_ptr, rows, cols, acc, row_ok, col_ok, stride_out, SWAP_AB: tl.constexpr):
    """Store the fp32 tile `acc` rounded to out's dtype at out[rows, cols] (rows and cols int64 or int32), where
    row_ok and col_ok: acc is [BM, BN], or its transpose [BN, BM] with SWAP_AB (`scaled_dot`'s layouts)."""
    if SWAP_AB:
        out = out_ptr + rows[None, :] * stride_out + cols[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])
    else:
        out = out_ptr + rows[:, None] * stride_out + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# one compile per tile for every M (decode batches vary); the activation scales' strides are (K groups, 1) or, in
# cuBLAS's column-major layout of a norm's `Fp8Rows`, (1, M rounded up to 4): not specialised either
@triton.jit(do_not_specialize=["M", "stride_asm", "stride_asg"])
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, M, N, K,
                     stride_am, stride_wn, stride_om, stride_asm, stride_asg, stride_wsn, stride_wsk,
                     GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, A_FP8: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     SWAP_AB: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // group_rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    w_scales = w_scale_ptr + (cols64 // GROUP_N) * stride_wsn
    # SWAP_AB: out^T = W a^T, the weight tile on the MMA's M side (wgmma needs 64 there; decode has few rows)
    if SWAP_AB:  # noqa: SIM108 (a constexpr branch)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        group = k0 // GROUP_K
        a = tl.load(a_ptr + rows64[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols64[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_scale = tl.load(w_scales + group * stride_wsk, mask=col_ok, other=0.0).to(tl.float32)
        if A_FP8:
            a_scale = tl.load(a_scale_ptr + rows64 * stride_asm + group * stride_asg, mask=row_ok, other=0.0)
        else:
            a_scale = tl.full((BLOCK_M,), 1.0, tl.float32)
            w = w.to(a.dtype)
        acc += scaled_dot(a, w, a_scale, w_scale, SWAP_AB, PRECISION)
    store_tile(out_ptr, rows64, cols64, acc, row_ok, col_ok, stride_om, SWAP_AB)


def _checked(name: str, a: torch.Tensor, a_scale: torch.Tensor | None, weight: torch.Tensor, scale: torch.Tensor,
             fmt: Fp8Format) -> tuple[int, int]:
    """The (GROUP_N, GROUP_K) of `fmt` after checking a GEMM's operands (`fp8_gemm`'s contract); ValueError
    naming `name` and what is wrong."""
    a_fp8 = a_scale is not None
    if a.dim() != 2 or weight.dim() != 2 or a.shape[1] != weight.shape[1]:
        raise ValueError(f"{name}: a [M, K] and weight [N, K] needed, got {list(a.shape)} and {list(weight.shape)}")
    if weight.dtype != FP8_DTYPE or (a.dtype == FP8_DTYPE) != a_fp8:
        raise ValueError(f"{name}: weight must be {FP8_DTYPE} and a too exactly when a_scale is given, got "
                         f"{a.dtype} (a_scale {'given' if a_fp8 else 'None'}) and {weight.dtype}")
    (m, k), n = a.shape, weight.shape[0]
    if tuple(scale.shape) != fmt.scale_shape(n, k) or scale.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{name}: scale {list(fmt.scale_shape(n, k))} fp32/bf16 needed for {fmt.describe()}, "
                         f"got {list(scale.shape)} {scale.dtype}")
    group_n, group_k = fmt.block if fmt.kind == "block" else (1, 128)
    if group_k < 16 or group_k & (group_k - 1):
        raise ValueError(f"{name}: the K group {group_k} must be a power of two >= 16")
    if a_fp8 and (tuple(a_scale.shape) != (m, -(-k // group_k)) or a_scale.dtype != torch.float32):
        raise ValueError(f"{name}: a_scale [{m}, {-(-k // group_k)}] fp32 needed, got {list(a_scale.shape)} "
                         f"{a_scale.dtype}")
    if a.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"{name} needs unit stride on K (activations and weight)")
    return group_n, group_k


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, weight: torch.Tensor, scale: torch.Tensor,
             fmt: Fp8Format, out_dtype: torch.dtype, config: TileConfig | None = None) -> torch.Tensor:
    """The launcher. a [M, K]: float8_e4m3fn with a_scale [M, ceil(K/bk)] fp32 (W8A8; bk = fmt.block[1], 128 for
    the channel format), or bf16/fp16/fp32 with a_scale None (W8A16); weight [N, K] float8_e4m3fn with `scale` in
    `fmt`'s shape (fp32 or bf16) -> out [M, N] in `out_dtype`. Unit stride on K is required; shapes, dtypes and
    strides are checked before the launch. `config`: None takes `decode_config` up to `DECODE_ROWS` rows, else
    `PREFILL_TILE`."""
    a_fp8 = a_scale is not None
    group_n, group_k = _checked("fp8_gemm", a, a_scale, weight, scale, fmt)
    (m, k), n = a.shape, weight.shape[0]
    config = config or (decode_config(m) if m <= DECODE_ROWS else PREFILL_TILE)
    block_k = min(config.block_k, group_k)
    if a.dtype == torch.float32:  # fp32 tiles take twice the shared memory
        block_k = min(block_k, 32)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m and n:
        grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
        _fp8_gemm_kernel[grid](
            a, a_scale if a_fp8 else a, weight, scale, out, m, n, k,
            a.stride(0), weight.stride(0), out.stride(0), a_scale.stride(0) if a_fp8 else 0,
            a_scale.stride(1) if a_fp8 else 0, scale.stride(0),
            scale.stride(1) if fmt.kind == "block" else 0,
            GROUP_N=group_n, GROUP_K=group_k, A_FP8=a_fp8, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            BLOCK_K=block_k, GROUP_M=config.group_m, SWAP_AB=config.swap_ab,
            PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out


@triton.jit(do_not_specialize=["M", "stride_asm", "stride_asg"])  # (the scales' strides: `_fp8_gemm_kernel`'s)
def _fp8_gemm_splitk_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, k_part,
                            stride_am, stride_wn, stride_om, stride_asm, stride_asg, stride_wsn, stride_wsk,
                            GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    # program (n, s): output columns [n * BLOCK_N, ...) over K [s * k_part, (s + 1) * k_part), swap-AB, W8A8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    w_scales = w_scale_ptr + (cols64 // GROUP_N) * stride_wsn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_end = tl.minimum(K, (pid_k + 1) * k_part)
    for k0 in range(pid_k * k_part, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        group = k0 // GROUP_K
        a = tl.load(a_ptr + rows64[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols64[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_scale = tl.load(w_scales + group * stride_wsk, mask=col_ok, other=0.0).to(tl.float32)
        a_scale = tl.load(a_scale_ptr + rows64 * stride_asm + group * stride_asg, mask=row_ok, other=0.0)
        acc += scaled_dot(a, w, a_scale, w_scale, True, "tf32")
    if SPLIT_K == 1:
        store_tile(out_ptr, rows64, cols64, acc, row_ok, col_ok, stride_om, True)
    else:
        # each part's fp32 tile to the workspace; the part that arrives last at the tile's counter sums the
        # parts in a fixed order (the same bits whichever arrives last), writes the output, resets the counter
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        parts = ws_ptr + pid_n.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M)
        tl.store(parts + pid_k * (BLOCK_N * BLOCK_M) + tile, acc)
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for part in tl.static_range(SPLIT_K):
                total += tl.load(parts + part * (BLOCK_N * BLOCK_M) + tile, cache_modifier=".cg")
            store_tile(out_ptr, rows64, cols64, total, row_ok, col_ok, stride_om, True)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")


# (device, workspace floats, counters) -> (workspace, counters): kept for the process's life, so a captured graph's
# launch always finds them (each launch leaves its counters at zero)
_SPLITK_BUFFERS: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def splitk_buffers(device: torch.device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K workspace (`floats` fp32) and `tiles` zeroed int32 counters for launches of this size on
    `device`: one pair per size, reused by every launch (launches on one stream: each finishes with its
    counters back at zero before the next starts); made outside a CUDA graph capture only (RuntimeError)."""
    key = (str(device), floats, tiles)
    if key not in _SPLITK_BUFFERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # zeroed inside a capture they would be zeroed only when the graph replays
            raise RuntimeError("fp8_gemm_splitk: its buffers are made by a first run outside a CUDA graph capture "
                               "(the engine runs each graph eagerly before capturing it)")
        _SPLITK_BUFFERS[key] = (torch.empty(floats, dtype=torch.float32, device=device),
                                torch.zeros(tiles, dtype=torch.int32, device=device))
    return _SPLITK_BUFFERS[key]


def fp8_gemm_splitk(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    fmt: Fp8Format, out_dtype: torch.dtype, config: SplitK) -> torch.Tensor:
    """W8A8 decode GEMM cut along K (`SplitK`): a [M, K] float8_e4m3fn (M <= 64) with a_scale [M, ceil(K/bk)]
    fp32, weight [N, K] float8_e4m3fn with `scale` in `fmt`'s shape -> out [M, N] in `out_dtype`, equal to
    `fp8_gemm`'s W8A8 product but for fp32 summation order (each part's sum, then the parts in order). Checked as
    `fp8_gemm`; BLOCK_M from M as `decode_config`. Its workspace and counters are `splitk_buffers`' (launches
    on one stream at a time per device)."""
    if a_scale is None or a.dtype != FP8_DTYPE or a.dim() != 2 or a.shape[0] > DECODE_ROWS:
        raise ValueError(f"fp8_gemm_splitk: W8A8 with at most {DECODE_ROWS} rows (a {FP8_DTYPE} with a_scale), got "
                         f"{a.dtype} {list(a.shape)}")
    if config.split_k < 1 or config.block_n < 16 or config.block_n & (config.block_n - 1):
        raise ValueError(f"fp8_gemm_splitk: split_k >= 1 and a power-of-two block_n >= 16 needed, got {config}")
    group_n, group_k = _checked("fp8_gemm_splitk", a, a_scale, weight, scale, fmt)
    (m, k), n = a.shape, weight.shape[0]
    block_m = decode_config(max(m, 1)).block_m
    block_k = min(128, group_k)
    steps = -(-k // block_k)
    k_part = -(-steps // config.split_k) * block_k
    split = -(-k // k_part)  # no empty part
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m and n:
        tiles = triton.cdiv(n, config.block_n)
        workspace, counts = splitk_buffers(a.device, tiles * split * config.block_n * block_m, tiles)
        _fp8_gemm_splitk_kernel[(tiles, split)](
            a, a_scale, weight, scale, out, workspace, counts, m, n, k, k_part,
            a.stride(0), weight.stride(0), out.stride(0), a_scale.stride(0), a_scale.stride(1), scale.stride(0),
            scale.stride(1) if fmt.kind == "block" else 0,
            GROUP_N=group_n, GROUP_K=group_k, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
            SPLIT_K=split, num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format,
               bias: torch.Tensor | None = None,
               quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) -> x W^T (+ bias) [..., N] in x's dtype: the split-K W8A8 decode tile where
    `fp8_decode_choice.splitk_config` gives one (`DECODE_SPLIT_K`, else measured on the device), else
    `library_linear`. `quantized`: x's activations already quantised (a norm's `layers.linear.Fp8Rows`: x [T, K]
    bf16/fp16 and `quantize_groups(x, fmt.block[1], pad_rows=4, column_major=True)`, block format), which every
    path then reads instead of quantising x (the same product)."""
    from hybridcache.kernels.gemm import fp8_decode_choice

    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if quantized is not None:
        _check_quantized(rows, quantized, fmt)
    split = fp8_decode_choice.splitk_config(rows, weight, scale, fmt)
    if split is not None:
        group = fmt.block[1] if fmt.kind == "block" else 128
        xq, x_scale = _rows_of(quantized, rows.shape[0]) or triton_quant.quantize_groups(rows, group)
        out = fp8_gemm_splitk(xq, x_scale, weight, scale, fmt, x.dtype, split)
    else:
        out = library_linear(rows, weight, scale, fmt, quantized)
    out = out.reshape(*lead, weight.shape[0])
    return out if bias is None else out + bias


def _check_quantized(rows: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor], fmt: Fp8Format) -> None:
    """ValueError unless `quantized` is `fp8_linear`'s pre-quantised input for rows [M, K]."""
    xq, x_scale = quantized
    m, k = rows.shape
    padded = -(-m // 4) * 4
    groups = -(-k // fmt.block[1]) if fmt.kind == "block" else 0
    if (fmt.kind != "block" or rows.dtype == torch.float32 or xq.dtype != FP8_DTYPE
            or tuple(xq.shape) != (padded, k) or tuple(x_scale.shape) != (padded, groups)
            or x_scale.stride() != (1, padded)):
        raise ValueError(f"fp8_linear: quantized input for {list(rows.shape)} {rows.dtype} needs the block format, "
                         f"xq [{padded}, {k}] {FP8_DTYPE} and a column-major scale [{padded}, {groups}], got "
                         f"{fmt.describe()}, {xq.dtype} {list(xq.shape)}, {list(x_scale.shape)} {x_scale.stride()}")


def _rows_of(quantized: tuple[torch.Tensor, torch.Tensor] | None, m: int
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first m rows of a pre-quantised input (the padding rows dropped), or None."""
    return None if quantized is None else (quantized[0][:m], quantized[1][:m])


def library_linear(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format,
                   quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """rows [M, K] (unit stride on K) -> rows W^T [M, N] without split-K: cuBLAS's block-scaled GEMM
    (`scaled_mm.block_fp8_linear`) from `CUBLAS_ROWS_FROM` rows where it applies (bf16/fp16, 128 x 128 blocks,
    N % 128 == K % 512 == 0), but not up to `DECODE_TRITON_SHAPES`' rows on its shapes; else this kernel, W8A8
    (or W8A16 with `DECODE_W8A16`) with `decode_config` up to `DECODE_ROWS` rows and `PREFILL_TILE` above (the
    choices measured: docs/kernels.md "Quantization"). `quantized`: `fp8_linear`'s."""
    from hybridcache.kernels.gemm import scaled_mm

    m = rows.shape[0]
    group = fmt.block[1] if fmt.kind == "block" else 128
    cublas = m >= CUBLAS_ROWS_FROM and m > DECODE_TRITON_SHAPES.get((weight.shape[0], weight.shape[1]), 0)
    if cublas and rows.dtype != torch.float32 and scaled_mm.block_scaled_mm_fits(weight, scale, fmt):
        return scaled_mm.block_fp8_linear(rows, weight, scale, quantized)
    if m <= DECODE_ROWS and DECODE_W8A16:
        return fp8_gemm(rows, None, weight, scale, fmt, rows.dtype, decode_config(m))
    xq, x_scale = _rows_of(quantized, m) or triton_quant.quantize_groups(rows, group)
    return fp8_gemm(xq, x_scale, weight, scale, fmt, rows.dtype, decode_config(m) if m <= DECODE_ROWS
                    else PREFILL_TILE)
