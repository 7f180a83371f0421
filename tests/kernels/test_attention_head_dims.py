"""The Triton paged-attention kernels (`attention/triton_paged.py`) at head dims that are not powers of two: 24 (the
hybrid families' tiny test configs: Jamba, Falcon-H1, Bamba, Nemotron-H), 80 and 192, and
32 / 128 as before. Their tiles are the dim rounded up to a power of two and the lanes past it masked.

- `test_interpreted_*` run on the CPU under TRITON_INTERPRET=1, in the child process that
  `test_attention_head_dims_in_a_triton_interpreter_subprocess` starts (this process never imports triton), fp32
  (the interpreter's bf16 matrix products are wrong): the prefill kernel (a fresh sequence, chunks over cached
  prefixes starting mid-page), its keys in 3 splits (with the merge), a mixed step's leading decode rows written by
  the decode kernel into the prefill kernel's output, and the decode kernel, through
  `cuda_checks.check_attention_lanes`, which puts NaN in the memory every padded lane addresses (q, the new keys and
  values, the output; the pool's unused slots), so a lane read unmasked shows as NaN and one written unmasked as
  lost padding.
- `test_cuda_*` run the same on a CUDA device (skipped without one) at bf16 and fp32 on the full varlen case.
Tolerances as tests/kernels/test_cuda_kernels.py's (fp32 in another order 1e-5; bf16 outputs 1e-2 / 2e-2).
test_hopper_compile.py checks that the lane masks compile away at power-of-two dims.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter
from tests.kernels.test_cuda_kernels import EXACT, OURS, _interpreter_runs_our_kernels, assert_within

DIMS = pytest.mark.parametrize("head_dim", [24, 80, 192, 32])
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
# (lengths, history, num_splits, lead): a fresh 17-token prompt, chunks over 5 / 150 / 100 cached keys (mid-page);
# the same in 3 key splits; 3 decode rows (one a fresh one-token prompt) leading a mixed step; decode only
SMALL = {
    "prefill": ((17, 5, 40), (0, 150, 100), 1, 0),
    "splits": ((1, 17, 5, 40), (0, 5, 150, 100), 3, 0),
    "lead": ((1, 1, 1, 20, 9), (130, 0, 37, 0, 40), 1, 3),
    "decode": ((1, 1, 1, 1), (0, 16, 40, 100), 1, 0),
}
CASES = pytest.mark.parametrize("case", sorted(SMALL))


def within(stats: dict, dtype: torch.dtype) -> None:
    """`check_attention_lanes`' results: the KV write exact, the output within `OURS`, its NaN padding kept."""
    assert stats.pop("out_padding_kept"), "a lane past the head dim was written"
    assert_within(stats, {"kv_write": EXACT, "out": OURS[dtype]})


@pytest.mark.skipif(not _interpreter_runs_our_kernels(), reason="this Triton's interpreter cannot run our kernels")
@interpreted_in_child("interpreted")
def test_attention_head_dims_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@needs_interpreter
@DIMS
@CASES
def test_interpreted_attention_at_any_head_dim(head_dim: int, case: str) -> None:
    from tests.kernels.cuda_checks import check_attention_lanes

    lengths, history, splits, lead = SMALL[case]
    within(check_attention_lanes(torch.float32, torch.device("cpu"), head_dim, lengths, history, num_splits=splits,
                                 lead=lead), torch.float32)


@needs_cuda
@DTYPES
@pytest.mark.parametrize("head_dim", [24, 80, 192, 128])
@pytest.mark.parametrize("case", ["prefill", "splits", "lead", "decode"])
def test_cuda_attention_at_any_head_dim(dtype: torch.dtype, head_dim: int, case: str) -> None:
    """The full varlen case (lengths 1 .. 1,500, cached 0 .. 130), 16 query heads on 2 kv heads, pages of 16; in 7
    key splits; 4 leading decode rows over up to 1,000 keys; decode over contexts of 1 .. 1,631."""
    from tests.kernels.cuda_checks import HISTORY, LENGTHS, check_attention_lanes

    lengths, history, splits, lead = LENGTHS, HISTORY, 1, 0
    if case == "splits":
        splits = 7
    elif case == "lead":
        lengths, history, lead = (1, 1, 1, 1, *LENGTHS[1:]), (1000, 0, 37, 300, *HISTORY[1:]), 4
    elif case == "decode":
        history = tuple(h + n - 1 for h, n in zip(HISTORY, LENGTHS, strict=True))
        lengths = (1,) * len(LENGTHS)
    within(check_attention_lanes(dtype, torch.device("cuda"), head_dim, lengths, history, heads=(16, 2),
                                 num_splits=splits, lead=lead), dtype)


@needs_interpreter
def test_interpreted_a_head_dim_over_256_is_refused() -> None:
    """Past 256 the tiles would be 512 wide, too big for shared memory (`triton_backend.MAX_HEAD_DIM`): a clear
    error, before any launch."""
    from hybridcache.kernels.attention.triton_paged import paged_decode_attention

    q, pool = torch.zeros(1, 2, 320), torch.zeros(2, 1, 16, 1, 320)
    with pytest.raises(ValueError, match="head dim 320 is over 256: the Triton attention kernels' tiles"):
        paged_decode_attention(q, pool, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1,
                               scale=1.0)
