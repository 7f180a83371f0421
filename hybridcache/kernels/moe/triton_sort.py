"""The MoE (token, pick) pairs sorted by expert, and the rows per expert, in one Triton launch (for up to
`MAX_PAIRS` pairs: decode steps and small chunks). torch takes five kernels for the same (the int16 cast, a
radix argsort, zeros, ones and a scatter_add) at a cost that does not depend on the size; one program's sort
grows with the pairs and with the experts, hence the limit (`benchmarks/moe_bench.py --sort`; the figures are in
docs/bench.md, "Figures behind the code's choices").

One program holds all N pairs. Pair i with expert e gets the key e * BLOCK_N + i, unique and ordered first by
expert, then by pair; sorting the keys (`tl.sort`) and keeping key % BLOCK_N gives the stable argsort of the
expert ids, exactly as `torch.argsort(ids, stable=True)`. Counts are a histogram of the ids. Padding lanes
(i >= N) take the expert id BLOCK_E - 1 > E - 1, so their keys sort after every real one and fall in a bin
that is not stored::

    ids   [2 0 2 1]  (N = 4, E = 3, BLOCK_N = 4, BLOCK_E = 4)
    keys  [8 1 10 7] -> sorted [1 7 8 10] -> order [1 3 0 2], counts [1 1 2]

With `shared` (an FP8 stack whose last expert E - 1 is the MoE block's shared expert, every token's pick k + 1),
the program sorts the T*k routed picks alone and appends the T shared pairs, whose place is known: pairs are
numbered in the [T, k + 1] layout (routed pair t*k + j is pair t*(k + 1) + j, a map that keeps their order), the
shared expert's run is pairs t*(k + 1) + k in token order, last, and counts[E - 1] = T. The result equals the
plain sort of the [T, k + 1] ids, and the sort is as wide as the routed picks' (bf16's bucket, not the next
power of two)::

    routed ids [[1 0] [0 1]]  (T = 2, k = 2, E = 3: expert 2 shared) -> routed order [1 2 0 3]
    -> pairs [1 3 0 4], then the shared run [2 5]: order [1 3 0 4 2 5], counts [2 2 2]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.kernels import pdl

MAX_PAIRS = 1024  # one program sorts them; more take torch's radix sort (`grouped.sort_pairs`)
MAX_EXPERTS = 1024  # the histogram's bins live in one program too (benchmarked up to 512 experts)
_MIN_BLOCK_N = 16


def block_size(num_pairs: int) -> int:
    """The BLOCK_N of a sort of `num_pairs` pairs: the pairs padded to a power of two, at least 16."""
    return triton.next_power_of_2(max(num_pairs, _MIN_BLOCK_N))


def sort_warps(block_n: int) -> int:
    """The sort's warps at BLOCK_N: 8 from 512 pairs (next-16b's 64-token step, 512 pairs: 2.8 against 4.0 us with
    4), else 4 (256 pairs: 2.0 against 2.2 with 8; `benchmarks/decode_kernel_sweep.py --only moe_route`, docs/bench.md
    session 71)."""
    return 8 if block_n >= 512 else 4


def block_sizes() -> tuple[int, ...]:
    """Every BLOCK_N `sort_pairs_triton` launches with (the pairs padded to a power of two, 16 .. MAX_PAIRS): one
    compiled variant each for a given expert count, which the engine compiles at start-up
    (`grouped.compile_tiles`)."""
    return tuple(1 << i for i in range(_MIN_BLOCK_N.bit_length() - 1, MAX_PAIRS.bit_length()))


@triton.jit(do_not_specialize=["num_pairs", "top_k"])  # BLOCK_N and SHARED tell the variants apart
def _sort_pairs_kernel(ids_ptr, order_ptr, counts_ptr, num_pairs, num_experts, top_k,
                       BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr, SHARED: tl.constexpr = False):
    pdl.start(PDL)
    sort_block(ids_ptr, order_ptr, counts_ptr, num_pairs, num_experts, top_k, BLOCK_N, BLOCK_E, SHARED)


@triton.jit
def sort_block(ids_ptr, order_ptr, counts_ptr, num_pairs, num_experts, top_k, BLOCK_N: tl.constexpr,
               BLOCK_E: tl.constexpr, SHARED: tl.constexpr):
    """The sort of `_sort_pairs_kernel` in the calling program (module docstring; FP8's decode prologue,
    `triton_fp8_moe.shared_prologue`, runs it beside other work in one launch)."""
    lanes = tl.arange(0, BLOCK_N)
    real = lanes < num_pairs
    experts = tl.load(ids_ptr + lanes, mask=real, other=BLOCK_E - 1).to(tl.int32)
    keys = tl.sort(experts * BLOCK_N + lanes)
    pairs = keys % BLOCK_N
    counts = tl.histogram(experts, BLOCK_E).to(tl.int32)
    bins = tl.arange(0, BLOCK_E)
    if SHARED:  # num_pairs = T*k routed picks; the shared expert's T pairs go last (module docstring)
        tokens = num_pairs // top_k
        pairs = pairs + pairs // top_k  # t*k + j -> t*(k + 1) + j
        tl.store(order_ptr + num_pairs + lanes, (lanes * (top_k + 1) + top_k).to(tl.int64), mask=lanes < tokens)
        counts = tl.where(bins == num_experts - 1, tokens, counts)
    tl.store(order_ptr + lanes, pairs.to(tl.int64), mask=real)
    tl.store(counts_ptr + bins, counts, mask=bins < num_experts)


def sort_pairs_triton(top_ids: torch.Tensor, num_experts: int, shared: bool = False,
                      num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """top_ids [T, k] int64, 1 <= T*k <= MAX_PAIRS, E <= MAX_EXPERTS -> (order [T*k] int64: the pairs stably
    sorted by expert, counts [E] int32), as `grouped.sort_pairs`. `shared`: top_ids are the routed picks (ids
    < E - 1) and expert E - 1 every token's pick k + 1: order [T*(k + 1)] over the [T, k + 1] pairs (module
    docstring). num_warps: the launch's (default `sort_warps`; benchmarks sweep it)."""
    flat = top_ids.reshape(-1)
    num_pairs = flat.numel()
    if not 0 < num_pairs <= MAX_PAIRS or num_experts > MAX_EXPERTS:
        raise ValueError(f"sort_pairs_triton sorts 1 to {MAX_PAIRS} pairs over at most {MAX_EXPERTS} experts, got "
                         f"{num_pairs} pairs over {num_experts}")
    tokens, top_k = top_ids.shape
    order = torch.empty(num_pairs + tokens * shared, dtype=torch.int64, device=flat.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    block_n = block_size(num_pairs)
    _sort_pairs_kernel[(1,)](flat, order, counts, num_pairs, num_experts, top_k, BLOCK_N=block_n,
                             BLOCK_E=triton.next_power_of_2(num_experts + 1), SHARED=shared,
                             num_warps=num_warps or sort_warps(block_n), **pdl.options(flat))
    return order, counts
