"""The FP8 routed experts' prefill launch choices (`triton_fp8_moe.fp8_grouped_experts` above the decode sizes),
kept apart from the kernel so benchmarks and tests read and set them without importing Triton.

Above `moe.grouped.tile_rows`' decode sizes both expert GEMMs run W8A8 with the `PrefillTile` of the rows'
bucket, decided from shapes alone (captured and eager runs agree): "small" up to `PREFILL_SMALL_ROWS` mean rows
per expert (phase A's short prefills), "large" above (chunks of 1,024 tokens of many sequences). Each bucket's
tile is the fastest `benchmarks/fp8_sweep.py --prefill` measured on the H200 (docs/bench.md, "FP8 on the H200");
the engine compiles every tile here at start-up (`triton_fp8_moe.compile_tiles`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillTile:
    """The W8A8 launch of both expert GEMMs above the decode sizes: BLOCK_M rows, `block_n` output columns of the
    gate/up GEMM (per accumulator: it keeps a gate and an up tile) and `down_block_n` of the down GEMM. The
    defaults are the tile used before the sweep (its first row)."""

    block_m: int = 64
    block_n: int = 128
    down_block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 0  # 0: a 2-D grid; else row tiles in groups of group_m (`triton_fp8_moe.fp8_expert_gemm`)


# Per-channel experts (a compressed-tensors checkpoint, or block-scaled ones re-quantised per output channel at
# start-up with EXPERTS_PER_CHANNEL) run above the decode sizes through torch's row-wise scaled grouped GEMM
# (`triton_fp8_moe.rowwise_expert_rows`) when ROWWISE_PREFILL, with Hopper's FP8 fast accumulation when
# ROWWISE_FAST_ACCUM; their decode stays on the Triton tiles. `fp8_sweep.py --rowwise` on the H200 (next-16b's
# experts at 16,384 / 4,096 / 1,024 tokens, ms): block-scaled Triton 6.26 / 1.67 / .508, row-wise 4.27 / 1.74 /
# .664, row-wise with fast accumulation 3.74 / 1.18 / .456 (its error no larger), bf16 5.64 / 1.53 / .548; the
# re-quantisation moves the byte LM's next-byte distributions by a third of the block format's own KL from bf16
# (`fp8_quality.py`, full accumulation; fast accumulation's is not measured on it, so it stays off);
# docs/bench.md, "FP8 on the H200"
ROWWISE_PREFILL = True
ROWWISE_FAST_ACCUM = False
ROWWISE_FULL_ACCUM_ROWS = 2048  # without fast accumulation, row-wise from this many mean rows per expert only
EXPERTS_PER_CHANNEL = True
# A sparse MoE block's FP8 shared expert, when its projections have the routed experts' format and widths, runs as
# one more expert of the routed experts' stack (`triton_fp8_moe.shared_fits`): every token picks it with weight
# sigmoid(its gate), so x is quantised once for both, and a decode step runs no dense GEMMs, SwiGLU or gated add of
# its own for it (its weights read in the experts' launch). Per-channel stacks re-quantise it as the routed ones.
SHARED_AS_EXPERT = True

PREFILL_SMALL_ROWS = 512
# `fp8_sweep.py --prefill` on the H200 (next-16b's experts): 64 x 64 at 4 warps, 3 stages, grouped order, fastest
# in both buckets (docs/bench.md, "FP8 on the H200")
PREFILL_TILES = {"small": PrefillTile(64, 64, 128, 4, 3, 8), "large": PrefillTile(64, 64, 128, 4, 3, 8)}


def prefill_bucket(num_rows: int, num_experts: int) -> str:
    """The `PREFILL_TILES` key of R = T*k rows over E experts."""
    return "small" if num_rows <= PREFILL_SMALL_ROWS * num_experts else "large"


@dataclass(frozen=True)
class DecodeTile:
    """The launch of one FP8 expert GEMM at decode sizes (`moe.grouped.tile_rows` gives a tile): BLOCK_M rows
    (which may differ from `tile_rows`' choice), `block_n` weight rows, `block_k`, warps, stages, swap-AB."""

    block_m: int
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = True


# (N_w, K, `tile_rows`' BLOCK_M) of an expert GEMM's stacked weight [E, N_w, K] -> its launch at decode sizes, where
# `benchmarks/decode_kernel_sweep.py --only fp8experts` measured one faster than `triton_fp8_moe`'s `DECODE_*`
# launch (docs/bench.md, "session 43, fp8h"); other shapes run that launch
# (`decode_kernel_sweep.py --only fp8experts` on the H200, 64 tokens, the shared expert stacked, us per launch:
# next-16b gate/up 80.2 -> 74.9, down 41.9 -> 40.8; the 80B shape's down 123.9 -> 111.6: its 4 K steps want fewer
# stages, and 32-row tiles read the shared expert's 64 rows in two tiles instead of four)
DECODE_TILES: dict[tuple[int, int, int], DecodeTile] = {
    (2048, 4096, 32): DecodeTile(64, 64, 128, 4, 4, swap_ab=False),  # next-16b gate/up at 33-64 tokens
    (4096, 1024, 32): DecodeTile(32, 64, 128, 4, 3),  # next-16b down
    (2048, 512, 16): DecodeTile(32, 64, 128, 4, 3),  # the 80B shape's down (512 experts top-10), up to 409 tokens
}

