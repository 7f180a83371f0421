"""`triton_paged.write_kv` (one Triton launch writes a layer's keys and values) against the reference `write_kv`:
the same pool, bit for bit, for keys and values that are views of a wider projection output (row stride > Hkv x D,
as the attention layer hands them over), in bf16, fp32 and into an FP8 pool (converted by torch, moved as bytes);
every fifth row negative (a graph's padding row: nothing written, the reference checked for it too).

`test_interpreted_*` run in a child pytest under TRITON_INTERPRET=1 (`test_triton_interpreter_in_subprocess`);
`test_cuda_*` on a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.kernels.attention import reference
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter

CASES = pytest.mark.parametrize("pool_dtype, dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32,
                                                                                          torch.float32),
                                                      (torch.float8_e4m3fn, torch.float32)],
                                ids=["bf16", "fp32", "fp8-pool"])


def check_write_kv(pool_dtype: torch.dtype, dtype: torch.dtype, device: torch.device, *, tokens: int = 37,
                   pages: int = 12, page: int = 16, kv_heads: int = 2, head_dim: int = 32) -> None:
    from hybridcache.kernels.attention.triton_paged import write_kv

    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(2, pages, page, kv_heads, head_dim, generator=gen).clamp(-400, 400).to(pool_dtype).to(device)
    want = pool.clone()
    width = kv_heads * head_dim
    projected = torch.randn(tokens, 3 * width, generator=gen).to(device, dtype)  # q | k | v of a fused projection
    keys = projected[:, width: 2 * width].view(tokens, kv_heads, head_dim)
    values = projected[:, 2 * width:].view(tokens, kv_heads, head_dim)
    rows = torch.randperm(pages * page, generator=gen)[:tokens]
    rows[::5] = -1  # padding rows: not written
    rows = rows.to(device)
    untouched = want.clone()
    reference.write_kv(want, keys, values, rows)
    flat_want, flat_untouched = want.view(2, -1, kv_heads, head_dim), untouched.view(2, -1, kv_heads, head_dim)
    written = rows[rows >= 0]
    assert torch.equal(flat_want[0, written].view(torch.uint8), keys[rows >= 0].to(pool_dtype).view(torch.uint8))
    others = torch.ones(pages * page, dtype=torch.bool, device=device)
    others[written] = False
    assert torch.equal(flat_want[:, others].view(torch.uint8), flat_untouched[:, others].view(torch.uint8))
    write_kv(pool, keys, values, rows)
    assert torch.equal(pool.view(torch.uint8), want.view(torch.uint8))  # written rows and untouched ones
    empty = torch.empty(0, kv_heads, head_dim, dtype=dtype, device=device)
    write_kv(pool, empty, empty, rows[:0])  # no token: nothing to do
    assert torch.equal(pool.view(torch.uint8), want.view(torch.uint8))


@interpreted_in_child("interpreted")
def test_triton_interpreter_in_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@needs_interpreter
@CASES
def test_interpreted_write_kv(pool_dtype: torch.dtype, dtype: torch.dtype) -> None:
    check_write_kv(pool_dtype, dtype, torch.device("cpu"))


@needs_cuda
@CASES
def test_cuda_write_kv(pool_dtype: torch.dtype, dtype: torch.dtype) -> None:
    check_write_kv(pool_dtype, dtype, torch.device("cuda"), tokens=300, pages=64, page=64, head_dim=256)
