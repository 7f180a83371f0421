"""The FP8 dense linear's split-K decode tile, chosen per weight shape by measurement on the device (as
`gemm/dense.py` chooses bf16's kernels).

`triton_block_fp8.fp8_linear` asks `splitk_config` for every call. A shape in `triton_block_fp8.DECODE_SPLIT_K`
(set by hand or from a sweep) takes that launch from its `min_rows`. Otherwise, on CUDA with `MEASURE`, bf16 /
fp16 activations and `FROM_ROWS` to `DECODE_ROWS` rows (BLOCK_M 64: phase D's 64-sequence decode steps), the
first call of a weight shape outside a graph capture (`decide`) replays, in a CUDA graph, the library's kernel
(`triton_block_fp8.library_linear`: cuBLAS's block-scaled GEMM or the Triton swap-AB tile) and each split-K
candidate (`candidates`), every one with its activation quantisation launch as the engine runs it, the weight
rotated with copies beyond L2's size; a split-K launch is kept when it is faster than the library's by `MARGIN`.
The engine runs each captured batch size eagerly before capturing it, so every shape is decided, and every tile
compiled, at start-up; a shape first met inside a capture runs the library's kernel and is not recorded. The
choice is per process (`choices()`): a graph and an eager step of one process run the same kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.fp8_format import Fp8Format

MEASURE = True  # measure split-K against the library's kernel at a shape's first decode call (else: the library)
FROM_ROWS = 33  # the rows from which a measured split-K launch runs (measured at 64 rows: BLOCK_M 64's bucket)
MARGIN = 0.95  # split-K replaces the library's kernel only when at least 5 % faster
COLD_BYTES = 128 << 20  # the weight copies cycled in a timed replay: more than the H200's 50 MB L2
_FAST = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Choice:
    """The measured choice for one weight shape: `config` None runs the library's kernel. `times_us`: each
    candidate's device time per call (the description -> microseconds), for the benchmarks' tables."""

    config: object | None
    times_us: tuple[tuple[str, float], ...]


_CHOICES: dict[tuple, Choice] = {}


def choices() -> dict[tuple, Choice]:
    """This process's decisions: (device, dtype, N, K, format) -> Choice."""
    return _CHOICES


def splitk_config(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format):
    """The `triton_block_fp8.SplitK` launch for rows [M, K] x weight [N, K]^T, or None (the library's kernel):
    `DECODE_SPLIT_K`'s for its shapes from their `min_rows`, else the measured choice (module docstring)."""
    from hybridcache.kernels.gemm import triton_block_fp8

    m, shape = rows.shape[0], (weight.shape[0], weight.shape[1])
    if not 0 < m <= triton_block_fp8.DECODE_ROWS:
        return None
    fixed = triton_block_fp8.DECODE_SPLIT_K.get(shape)
    if fixed is not None:
        return fixed if m >= fixed.min_rows else None
    if not (MEASURE and rows.is_cuda and rows.dtype in _FAST and m >= FROM_ROWS):
        return None
    key = (rows.device, rows.dtype, *shape, fmt)
    choice = _CHOICES.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        decide(weight, scale, fmt, rows.dtype)
        choice = _CHOICES[key]
    return choice.config


def candidates(n: int, k: int, sms: int) -> list:
    """The split-K launches tried for a [64, k] x [n, k]^T decode GEMM: 64 weight rows a program (4 warps, 4
    stages) and 128 (8 warps, 3 stages), each with the smallest power of two of K parts that fills the device's
    `sms` and twice that (1-2 waves), at most one part per K step of 128; a launch of one part only where it
    already fills them."""
    from hybridcache.kernels.gemm.triton_block_fp8 import SplitK

    most = max(1, k // 128)
    found = []
    for block_n, warps, stages in ((64, 4, 4), (128, 8, 3)):
        tiles = -(-n // block_n)
        split = 1
        while tiles * split < sms and 2 * split <= most:
            split *= 2
        for parts in sorted({split, min(2 * split, most)}):
            found.append(SplitK(block_n, parts, warps, stages, FROM_ROWS))
    return found


@torch.no_grad()
def decide(weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype) -> None:
    """Time the library's kernel and every split-K candidate on this weight's shape at `DECODE_ROWS` rows and
    record the fastest (module docstring). Synchronises the device; runs each candidate eagerly first (compiles)."""
    from hybridcache.kernels.gemm import triton_block_fp8, triton_quant
    from hybridcache.kernels.gemm.dense import replay_us

    device, (n, k) = weight.device, weight.shape
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    copies = min(63, -(-COLD_BYTES // max(1, weight.numel() * weight.element_size())) - 1)
    weights = [weight] + [weight.clone() for _ in range(copies)]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(triton_block_fp8.DECODE_ROWS, k, generator=gen, device=device).to(dtype)
    group = fmt.block[1] if fmt.kind == "block" else 128
    runs = {"library": (None, lambda w: triton_block_fp8.library_linear(x, w, scale, fmt))}
    for config in candidates(n, k, sms):
        runs[f"split-K {config.block_n} x {config.split_k}"] = (config, lambda w, c=config: (
            triton_block_fp8.fp8_gemm_splitk(*triton_quant.quantize_groups(x, group), w, scale, fmt, dtype, c)))
    times = {name: replay_us(run, weights, device) for name, (_, run) in runs.items()}
    best = min(times, key=times.get)
    if times[best] > MARGIN * times["library"]:
        best = "library"
    _CHOICES[(device, dtype, n, k, fmt)] = Choice(runs[best][0], tuple(times.items()))
    del weights
    torch.cuda.synchronize(device)
