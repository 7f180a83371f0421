"""The dense (bf16 / fp16) linear of a model's projections, chosen per shape by measurement on the device.

    linear(x, weight, bias)          x [..., K], weight [N, K], bias [N] or None -> x W^T (+ bias) [..., N]
    swiglu_linear(gate, up, weight, bias, silu_mul)     linear(silu_mul(gate, up), weight, bias), fused where the
                                     skinny GEMM runs (it makes silu(gate) * up as it loads its tiles)

`linear` is `F.linear` except on CUDA in bf16 / fp16 for at most `triton_skinny.MAX_ROWS` rows (a decode step):
there, for each (N, K, bias, dtype) and each row bucket (16, 32, 64; `triton_skinny.block_rows`), it runs whichever
of cuBLAS (`F.linear`), cuBLASLt's bias epilogue with a zero bias (`CUBLASLT`, for a linear without a bias:
cuBLASLt's own kernel heuristics) and the skinny Triton GEMM's candidate launches (`candidates`) replayed fastest in
a CUDA graph (anything but cuBLAS only when faster by `MARGIN`) the first time that weight shape was seen outside a
capture (`decide`: every bucket at once, the weight rotated with random copies beyond L2's size so each replay reads
it from memory, as a decode step does). The engine runs each captured batch size eagerly before capturing it, so
every shape is decided, and every tile compiled, at start-up (`swiglu_linear`'s fused variant too, every bucket at
its first call); a shape first seen during a capture runs cuBLAS and is not recorded. The choice table is per
process (`choices()`): a captured graph and an eager step of one process run the same kernels; two processes may
choose differently where two kernels time within a few per cent of each other (bf16 results then differ in rounding
between the processes), which `MARGIN` makes rarer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridcache.kernels.parallel_compile import compiles_only

REPS = 20  # GEMMs per timed graph replay
MARGIN = 0.95  # the skinny GEMM replaces cuBLAS only when at least 5 % faster (a near tie would flip between runs)
COLD_BYTES = 128 << 20  # the weight copies cycled in a timed replay: more than the H200's 50 MB L2
LARGE_BYTES = 256 << 20  # a weight this large is tried on fewer skinny launches (`candidates`)
_FAST = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class CublasLt:
    """A `Choice.config`: `F.linear` with a zero bias, so cuBLASLt's bias epilogue picks the kernel (its own
    heuristics; cuBLAS's `F.linear` without a bias may choose another)."""

    def describe(self) -> str:
        return "cublaslt bias0"


CUBLASLT = CublasLt()


@dataclass(frozen=True)
class Choice:
    """The measured choice for one (shape, row bucket): `config` None runs cuBLAS. `times_us`: each candidate's
    device time per GEMM (the description -> microseconds), for the benchmark's table."""

    config: object | None
    times_us: tuple[tuple[str, float], ...]


_CHOICES: dict[tuple, Choice] = {}
_ZERO_BIAS: dict[tuple, torch.Tensor] = {}  # (device, dtype, N) -> zeros [N], for the CUBLASLT choice


def choices() -> dict[tuple, Choice]:
    """This process's decisions: (device, dtype, N, K, has_bias, BLOCK_M) -> Choice."""
    return _CHOICES


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ bias), as `F.linear` (module docstring: when it runs the skinny GEMM instead)."""
    config = _skinny_choice(x, weight, bias)
    if config is None:
        return F.linear(x, weight, bias)
    if config == CUBLASLT:
        return F.linear(x, weight, _ZERO_BIAS[(weight.device, weight.dtype, weight.shape[0])])
    from hybridcache.kernels.gemm.triton_skinny import skinny_linear

    rows, (n, k) = x.numel() // x.shape[-1], weight.shape
    flat = x.reshape(rows, k)
    return skinny_linear(flat if flat.stride(1) == 1 else flat.contiguous(), weight, bias, config).view(
        *x.shape[:-1], n)


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`linear(silu_mul(gate, up), weight, bias)` (an MLP's down projection; gate, up [T, K] column views of its
    fused gate|up output, `silu_mul` the backend's op): where `linear` would run the skinny GEMM, one launch that
    makes silu(gate) * up as it loads its tiles, with `activation.silu_mul`'s roundings (the same result)."""
    config = _skinny_choice(gate, weight, bias) if gate.dim() == 2 and up.stride(-1) == gate.stride(-1) == 1 else None
    if config is None or config == CUBLASLT:
        return linear(silu_mul(gate, up), weight, bias)
    from hybridcache.kernels.gemm.triton_skinny import skinny_linear

    if (gate.device, gate.dtype, *weight.shape, bias is not None) not in _SWIGLU_COMPILED:
        _compile_swiglu(weight, bias)
    return skinny_linear(gate, weight, bias, config, up=up)


_SWIGLU_COMPILED: set[tuple] = set()


def _compile_swiglu(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Compile the skinny GEMM's SWIGLU variant of every row bucket's choice (launched on gate and up views of one
    [rows, 2K] tensor, the MLP's layout, under `compiles_only`), so that the first call compiles them all, at
    start-up, not the first request of another bucket. Not while a graph is being captured (then it waits for an
    eager call)."""
    from hybridcache.kernels.gemm.triton_skinny import MAX_ROWS, SkinnyConfig, block_rows, skinny_linear

    if torch.cuda.is_current_stream_capturing():
        return
    n, k = weight.shape
    with compiles_only():  # the buckets' variants compile side by side (on the start-up's pool)
        for rows in (16, 32, MAX_ROWS):
            choice = _CHOICES.get((weight.device, weight.dtype, n, k, bias is not None, block_rows(rows)))
            if choice is not None and isinstance(choice.config, SkinnyConfig):
                gate, up = torch.zeros(rows, 2 * k, dtype=weight.dtype, device=weight.device).split([k, k], dim=-1)
                skinny_linear(gate, weight, bias, choice.config, up=up)
    _SWIGLU_COMPILED.add((weight.device, weight.dtype, n, k, bias is not None))


def _skinny_choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The skinny GEMM's `SkinnyConfig` measured fastest for this call's shape and row bucket, or None where
    cuBLAS (`F.linear`) runs: off CUDA, outside bf16 / fp16, above `MAX_ROWS` rows, for a weight without unit
    stride on K, and for a shape first met inside a graph capture (then nothing is recorded)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not x.is_cuda or x.dtype not in _FAST or weight.dtype != x.dtype or rows == 0 or weight.stride(1) != 1:
        return None
    from hybridcache.kernels.gemm import triton_skinny

    if rows > triton_skinny.MAX_ROWS:
        return None
    n, k = weight.shape
    key = (x.device, x.dtype, n, k, bias is not None, triton_skinny.block_rows(rows))
    choice = _CHOICES.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        decide(weight, bias is not None)
        choice = _CHOICES[key]
    if getattr(choice.config, "tma", False) and not triton_skinny.tma_ready(weight):
        return None  # a weight view without TMA's alignment (a model's own weights have it)
    return choice.config


# The skinny GEMM's tiles tried per BLOCK_M: (weight rows, depth, stages, warps), by pointer loads and by TMA.
# Session 44's sweep (docs/bench.md, dec17b) timed 64 x 64, 128 x 64, 128 x 128 and 256 x 64 tiles and stream-K
# grids too; none was chosen over these on next-1b's or next-16b's shapes.
TILES = {16: ((64, 128, 4, 4),), 32: ((64, 128, 4, 4),), 64: ((64, 128, 4, 4),)}
MAX_SPLIT = 16  # K slices at most (each count is its own compile)


def split_counts(n: int, k: int, block_n: int, block_k: int, sms: int) -> list[int]:
    """The K slices tried for a tile: unsplit, and once and half the smallest power of two that fills the device's
    `sms` (at most one slice per K step, `MAX_SPLIT`)."""
    tiles, most = -(-n // block_n), min(MAX_SPLIT, max(1, k // block_k))
    split = 1
    while tiles * split < sms and 2 * split <= most:
        split *= 2
    return sorted({s for s in (1, split // 2, split) if s >= 1})


def candidates(n: int, k: int, m: int, sms: int) -> list:
    """The skinny GEMM's launches tried for [m, k] x [n, k]^T: `TILES[block_rows(m)]`, each by pointer loads and
    by TMA (pointer loads only for a weight over `LARGE_BYTES` and at 64 rows), each at `split_counts` slices, where
    `fits` holds."""
    from hybridcache.kernels.gemm.triton_skinny import SkinnyConfig, block_rows, fits

    found = []
    pointers_only = 2 * n * k > LARGE_BYTES or block_rows(m) == 64  # (start-up compiles: TMA won neither case)
    for block_n, block_k, stages, warps in TILES[block_rows(m)]:
        for tma in (False,) if pointers_only else (False, True):
            for s in split_counts(n, k, block_n, block_k, sms):
                config = SkinnyConfig(block_n=block_n, block_k=block_k, split_k=s, num_warps=warps,
                                      num_stages=stages, tma=tma)
                if fits(n, k, m, config):
                    found.append(config)
    return found


@torch.no_grad()
def decide(weight: torch.Tensor, has_bias: bool) -> None:
    """Measure cuBLAS and every candidate tile for each row bucket of this weight's shape and record the fastest
    (module docstring). The weight itself is read, with random copies of it added until they exceed `COLD_BYTES`
    (none for a weight that large: a model's largest, e.g. a 150k-token lm_head, is not copied). Synchronises the
    device; compiles every candidate first (side by side inside `parallel_compiles`)."""
    from hybridcache.kernels.gemm import triton_skinny

    device, dtype, (n, k) = weight.device, weight.dtype, weight.shape
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    extra = min(63, -(-COLD_BYTES // max(1, weight.numel() * weight.element_size())) - 1)
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [weight] + [(torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(dtype)
                          for _ in range(extra)]
    bias = torch.randn(n, generator=gen, device=device).to(dtype) if has_bias else None
    xs = {block_m: torch.randn(block_m, k, generator=gen, device=device).to(dtype)
          for block_m in (16, 32, triton_skinny.MAX_ROWS)}
    tried = {block_m: [c for c in candidates(n, k, block_m, sms) if not c.tma or triton_skinny.tma_ready(weight)]
             for block_m in xs}
    with compiles_only():  # every candidate's compile at once (on the start-up's pool), then each timed in turn
        for block_m, x in xs.items():
            for config in tried[block_m]:
                triton_skinny.skinny_linear(x, weight, bias, config)
    for block_m, x in xs.items():
        runs = {"cublas": (None, lambda w, x=x: F.linear(x, w, bias))}
        if not has_bias:
            zero = _ZERO_BIAS.setdefault((device, dtype, n), torch.zeros(n, dtype=dtype, device=device))
            runs[CUBLASLT.describe()] = (CUBLASLT, lambda w, x=x, zero=zero: F.linear(x, w, zero))
        for config in tried[block_m]:
            runs[config.describe()] = (config, lambda w, x=x, c=config: triton_skinny.skinny_linear(x, w, bias, c))
        times = {name: replay_us(run, weights, device) for name, (_, run) in runs.items()}
        best = min(times, key=times.get)
        if times[best] > MARGIN * times["cublas"]:
            best = "cublas"
        _CHOICES[(device, dtype, n, k, has_bias, block_m)] = Choice(runs[best][0], tuple(times.items()))
    del weights
    torch.cuda.synchronize(device)


def replay_us(run, weights: list[torch.Tensor], device: torch.device) -> float:
    """Device microseconds per GEMM of `run` over the weight copies, captured in one CUDA graph of `REPS` calls
    (what a decode graph replays: no launch overhead), the median of 5 replays. `run` is called eagerly first."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            run(w)
        stream.synchronize()
        graph.capture_begin()  # not `torch.cuda.graph`: its gc.collect per capture would slow the engine's start
        for i in range(REPS):
            run(weights[i % len(weights)])
        graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph.replay()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(1000 * start.elapsed_time(end) / REPS)
    del graph
    return sorted(samples)[len(samples) // 2]
