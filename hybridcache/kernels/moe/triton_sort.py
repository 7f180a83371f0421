"""The MoE (token, pick) pairs sorted by expert, and the rows per expert, in one Triton launch (for up to
`MAX_PAIRS` pairs: decode steps and small chunks). torch takes five kernels for the same (the int16 cast, a
radix argsort, zeros, ones and a scatter_add), ~0.02 ms a layer whatever the size; this takes 0.002-0.004 ms up
to 512 pairs and 0.010 at 1,024, but one program's sort grows with the pairs (0.020 ms at 2,048, 0.078 at
4,096) and with the experts (512 experts: 0.011 ms at 640 pairs, 0.026 at 1,280), hence the limit
(`benchmarks/moe_bench.py --sort`, H200, docs/kernels.md).

One program holds all N pairs. Pair i with expert e gets the key e * BLOCK_N + i, unique and ordered first by
expert, then by pair; sorting the keys (`tl.sort`) and keeping key % BLOCK_N gives the stable argsort of the
expert ids, exactly as `torch.argsort(ids, stable=True)`. Counts are a histogram of the ids. Padding lanes
(i >= N) take the expert id BLOCK_E - 1 > E - 1, so their keys sort after every real one and fall in a bin
that is not stored::

    ids   [2 0 2 1]  (N = 4, E = 3, BLOCK_N = 4, BLOCK_E = 4)
    keys  [8 1 10 7] -> sorted [1 7 8 10] -> order [1 3 0 2], counts [1 1 2]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PAIRS = 1024  # one program sorts them; more take torch's radix sort (`grouped.sort_pairs`)
MAX_EXPERTS = 1024  # the histogram's bins live in one program too (measured up to 512 experts)
_MIN_BLOCK_N = 16


def block_size(num_pairs: int) -> int:
    """The BLOCK_N of a sort of `num_pairs` pairs: the pairs padded to a power of two, at least 16."""
    return triton.next_power_of_2(max(num_pairs, _MIN_BLOCK_N))


def block_sizes() -> tuple[int, ...]:
    """Every BLOCK_N `sort_pairs_triton` launches with (the pairs padded to a power of two, 16 .. MAX_PAIRS): one
    compiled variant each for a given expert count, which the engine compiles at start-up
    (`grouped.compile_tiles`)."""
    return tuple(1 << i for i in range(_MIN_BLOCK_N.bit_length() - 1, MAX_PAIRS.bit_length()))


@triton.jit(do_not_specialize=["num_pairs"])  # BLOCK_N alone tells the variants apart (`block_sizes`)
def _sort_pairs_kernel(ids_ptr, order_ptr, counts_ptr, num_pairs, num_experts,
                       BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    lanes = tl.arange(0, BLOCK_N)
    real = lanes < num_pairs
    experts = tl.load(ids_ptr + lanes, mask=real, other=BLOCK_E - 1).to(tl.int32)
    keys = tl.sort(experts * BLOCK_N + lanes)
    tl.store(order_ptr + lanes, (keys % BLOCK_N).to(tl.int64), mask=real)
    bins = tl.arange(0, BLOCK_E)
    tl.store(counts_ptr + bins, tl.histogram(experts, BLOCK_E).to(tl.int32), mask=bins < num_experts)


def sort_pairs_triton(top_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_ids [T, k] int64, 1 <= T*k <= MAX_PAIRS, E <= MAX_EXPERTS -> (order [T*k] int64: the pairs stably
    sorted by expert, counts [E] int32), as `grouped.sort_pairs`."""
    flat = top_ids.reshape(-1)
    num_pairs = flat.numel()
    if not 0 < num_pairs <= MAX_PAIRS or num_experts > MAX_EXPERTS:
        raise ValueError(f"sort_pairs_triton sorts 1 to {MAX_PAIRS} pairs over at most {MAX_EXPERTS} experts, got "
                         f"{num_pairs} pairs over {num_experts}")
    order = torch.empty(num_pairs, dtype=torch.int64, device=flat.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    block_n = block_size(num_pairs)
    _sort_pairs_kernel[(1,)](flat, order, counts, num_pairs, num_experts, BLOCK_N=block_n,
                             BLOCK_E=triton.next_power_of_2(num_experts + 1), num_warps=4 if block_n <= 1024 else 8)
    return order, counts
