"""copy_blocks against a plain Python reference: torch path, Triton kernel, launcher errors.

The Triton kernel runs on the CPU under TRITON_INTERPRET=1, which must be set before triton is imported;
so the `test_triton_interpreted_*` tests run in a child pytest process started by
`test_triton_interpreter_in_subprocess` (this process never imports triton). Under a CUDA device the
`test_cuda_*` tests compare both paths on the GPU.
"""

from __future__ import annotations

import sys

import pytest
import torch

from hybridcache.kernels.copy.block_copy import copy_blocks
from tests.kernels.interpreter import INTERPRETED, interpreted_in_child, needs_cuda, needs_interpreter


def reference_copy(
    pool: torch.Tensor, src_ids: list[int], dst_ids: list[int], pages_per_block: int, page_dim: int
) -> torch.Tensor:
    """A new pool where every destination block holds its source block (page-dim slices, pair by pair)."""
    out = pool.clone()
    for src, dst in zip(src_ids, dst_ids, strict=True):
        src_pages = pool.narrow(page_dim, src * pages_per_block, pages_per_block)
        out.narrow(page_dim, dst * pages_per_block, pages_per_block).copy_(src_pages)
    return out


def random_pool(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype=dtype, device=device)


def random_plan(num_blocks: int, num_pairs: int, seed: int) -> tuple[list[int], list[int]]:
    """Unique destinations; sources drawn with repeats from the other blocks."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    dst_ids = order[:num_pairs]
    candidates = order[num_pairs:]
    picks = torch.randint(0, max(1, len(candidates) // 2), (num_pairs,), generator=generator).tolist()
    return [candidates[i] for i in picks], dst_ids


def kv_shape(num_pages: int) -> tuple[int, ...]:
    """[num_attention_layers, 2, num_pages, kernel_block_size, num_kv_heads, head_dim]"""
    return (3, 2, num_pages, 4, 2, 8)


def check_copy_blocks(
    impl: str, pages_per_block: int, dtype: torch.dtype, seed: int, device: str = "cpu", **kwargs: int
) -> None:
    num_blocks = 12
    pool = random_pool(kv_shape(num_blocks * pages_per_block), dtype, seed, device)
    src_ids, dst_ids = random_plan(num_blocks, 5, seed)
    assert len(set(src_ids)) < len(src_ids), "the plan must repeat a source"
    expected = reference_copy(pool, src_ids, dst_ids, pages_per_block, page_dim=2)
    assert not torch.equal(expected, pool)
    copy_blocks(pool, torch.tensor(src_ids), torch.tensor(dst_ids, dtype=torch.int32),
                pages_per_block=pages_per_block, impl=impl, **kwargs)
    assert torch.equal(pool, expected)


# ---- torch path ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pages_per_block", [1, 2, 4], ids=lambda n: f"ppb{n}")
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_copy_blocks_matches_reference(pages_per_block: int, dtype: torch.dtype, seed: int) -> None:
    check_copy_blocks("torch", pages_per_block, dtype, seed)


@pytest.mark.parametrize("workspace_pages", [1, 3, 7], ids=lambda n: f"ws{n}pages")
def test_torch_copy_blocks_tiles_within_workspace(
    workspace_pages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    page_bytes = 4 * 2 * 8 * 4  # kernel_block_size * heads * head_dim * fp32
    budget = workspace_pages * page_bytes
    largest: list[int] = []
    original = torch.Tensor.index_select

    def recording_index_select(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        out = original(self, dim, index)
        largest.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(torch.Tensor, "index_select", recording_index_select)
    check_copy_blocks("torch", 2, torch.float32, seed=3, max_workspace_bytes=budget)
    assert len(largest) > 1 and max(largest) <= budget


def test_torch_copy_blocks_one_tile_when_workspace_is_large(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda t, d, i: calls.append(1) or original(t, d, i))
    check_copy_blocks("torch", 4, torch.bfloat16, seed=4)
    assert len(calls) == 1


def test_auto_on_cpu_uses_torch_path() -> None:
    check_copy_blocks("auto", 2, torch.bfloat16, seed=5)


def test_other_page_dim() -> None:
    pool = random_pool((2, 9, 3, 5), torch.float32, 6)  # [outer, num_pages, ...], blocks of 3 pages
    expected = reference_copy(pool, [2, 2], [0, 1], pages_per_block=3, page_dim=1)
    copy_blocks(pool, torch.tensor([2, 2]), torch.tensor([0, 1]), pages_per_block=3, page_dim=1, impl="torch")
    assert torch.equal(pool, expected)


def check_self_copies(impl: str) -> None:
    """A pair may copy a block onto itself (a speculative step's select keeping a slot's own state) while other
    pairs read that block: the others land, the block stays; a destination that another pair reads is refused."""
    pool = random_pool((3, 10, 2, 4), torch.float32, 11)  # a state group: [layers, rows, *state]
    src, dst = [5, 5, 8, 2], [5, 7, 1, 2]
    expected = reference_copy(pool, src, dst, pages_per_block=1, page_dim=1)
    assert not torch.equal(expected, pool)
    copy_blocks(pool, torch.tensor(src), torch.tensor(dst), pages_per_block=1, page_dim=1, impl=impl)
    assert torch.equal(pool, expected)
    before = pool.clone()
    with pytest.raises(ValueError, match=r"disjoint from src_ids; both hold \[5\]"):
        copy_blocks(pool, torch.tensor([7, 5]), torch.tensor([5, 9]), pages_per_block=1, page_dim=1, impl=impl)
    assert torch.equal(pool, before)


def test_torch_self_copies() -> None:
    check_self_copies("torch")


@pytest.mark.parametrize("impl", ["torch", "auto"])
def test_empty_plan_is_a_no_op(impl: str) -> None:
    pool = random_pool(kv_shape(8), torch.bfloat16, 7)
    before = pool.clone()
    empty = torch.empty(0, dtype=torch.int64)
    copy_blocks(pool, empty, empty, pages_per_block=2, impl=impl)
    copy_blocks(pool.view(3, 2 * 8, -1), empty, empty, pages_per_block=1, page_dim=1, impl=impl)
    assert torch.equal(pool, before)


# ---- launcher errors ----------------------------------------------------------------------------------

IDS = torch.tensor([1, 2])


def _pool() -> torch.Tensor:
    return torch.zeros(kv_shape(8))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: copy_blocks([0], IDS, IDS + 2, pages_per_block=1), TypeError, "pool must be a torch.Tensor"),
        (lambda: copy_blocks(_pool().to_sparse(), IDS, IDS + 2, pages_per_block=1), ValueError, "dense"),
        (lambda: copy_blocks(_pool().transpose(0, 1), IDS, IDS + 2, pages_per_block=1), ValueError,
         "contiguous"),
        (lambda: copy_blocks(_pool(), IDS, IDS + 2, pages_per_block=1, page_dim=6), ValueError, "page_dim"),
        (lambda: copy_blocks(_pool(), IDS, IDS + 2, pages_per_block=1, page_dim=-1), ValueError, "page_dim"),
        (lambda: copy_blocks(_pool(), IDS, IDS + 2, pages_per_block=0), ValueError, "pages_per_block"),
        (lambda: copy_blocks(_pool(), IDS, IDS + 2, pages_per_block=2.0), ValueError, "pages_per_block"),
        (lambda: copy_blocks(_pool(), IDS, IDS + 2, pages_per_block=9), ValueError, "exceeds"),
        (lambda: copy_blocks(_pool(), [1, 2], IDS + 2, pages_per_block=1), TypeError, "src_ids must be a"),
        (lambda: copy_blocks(_pool(), IDS.float(), IDS + 2, pages_per_block=1), TypeError, "int32 or int64"),
        (lambda: copy_blocks(_pool(), IDS, (IDS + 2).to(torch.int16), pages_per_block=1), TypeError,
         "dst_ids must be int32 or int64"),
        (lambda: copy_blocks(_pool(), IDS[None], IDS[None] + 2, pages_per_block=1), ValueError, "1-D"),
        (lambda: copy_blocks(_pool(), IDS, IDS.to("meta"), pages_per_block=1), ValueError, "pool's device"),
        (lambda: copy_blocks(_pool(), IDS, torch.tensor([3, 4, 5]), pages_per_block=1), ValueError,
         "2 ids but dst_ids has 3"),
        (lambda: copy_blocks(_pool(), IDS, torch.tensor([3, 4]), pages_per_block=2), ValueError,
         r"dst_ids must lie in \[0, 4\)"),
        (lambda: copy_blocks(_pool(), torch.tensor([-1, 2]), IDS + 2, pages_per_block=1), ValueError,
         r"src_ids must lie in \[0, 8\)"),
        (lambda: copy_blocks(_pool(), IDS, torch.tensor([3, 3]), pages_per_block=1), ValueError, "unique"),
        (lambda: copy_blocks(_pool(), IDS, torch.tensor([3, 1]), pages_per_block=1), ValueError,
         r"disjoint from src_ids; both hold \[1\]"),
        (lambda: copy_blocks(_pool(), IDS, IDS + 2, pages_per_block=1, impl="cuda"), ValueError, "impl must"),
        (lambda: copy_blocks(_pool(), IDS, IDS + 2, pages_per_block=1, impl="torch", max_workspace_bytes=100),
         ValueError, "max_workspace_bytes"),
        (lambda: copy_blocks(torch.zeros(2, 4, 3), IDS, torch.tensor([0, 4]), pages_per_block=1, page_dim=1),
         ValueError, r"dst_ids must lie in \[0, 4\)"),
    ],
    ids=[
        "pool-not-tensor", "pool-sparse", "pool-not-contiguous", "page-dim-too-large", "page-dim-negative",
        "ppb-zero", "ppb-not-int", "ppb-too-large", "ids-not-tensor", "src-float", "dst-int16", "ids-2d",
        "ids-other-device", "length-mismatch", "dst-out-of-range", "src-negative", "dst-repeats",
        "dst-overlaps-src", "unknown-impl", "workspace-below-one-page", "slot-out-of-range",
    ],
)
def test_launcher_errors(call, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()


def test_errors_leave_the_pool_untouched() -> None:
    pool = random_pool(kv_shape(8), torch.float32, 8)
    before = pool.clone()
    with pytest.raises(ValueError, match="disjoint"):
        copy_blocks(pool, torch.tensor([1, 2]), torch.tensor([3, 1]), pages_per_block=1, impl="torch")
    assert torch.equal(pool, before)


@pytest.mark.skipif(INTERPRETED, reason="only meaningful without TRITON_INTERPRET")
def test_triton_on_cpu_without_interpreter_is_refused() -> None:
    kernel_module = "hybridcache.kernels.copy.triton"
    imported_before = kernel_module in sys.modules
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        copy_blocks(_pool(), IDS, IDS + 2, pages_per_block=1, impl="triton")
    assert (kernel_module in sys.modules) == imported_before, "the refusal must come before the import"


# ---- Triton kernel under the interpreter (child process) ----------------------------------------------


@interpreted_in_child("triton_interpreted", timeout=300)
def test_triton_interpreter_in_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pages_per_block", [1, 2, 4], ids=lambda n: f"ppb{n}")
def test_triton_interpreted_copy_blocks(pages_per_block: int, dtype: torch.dtype) -> None:
    check_copy_blocks("triton", pages_per_block, dtype, seed=10 + pages_per_block)


@needs_interpreter
def test_triton_interpreted_self_copies() -> None:
    check_self_copies("triton")


@needs_interpreter
@pytest.mark.parametrize(
    ("dtype", "page_shape", "offset", "word"),
    [
        (torch.float16, (3,), 0, 2),  # 6-byte page rows -> 2-byte words
        (torch.uint8, (5,), 0, 1),  # 5-byte page rows -> bytes
        (torch.float32, (2,), 1, 4),  # 8-byte rows at an address 4 past an 8-aligned one -> 4-byte words
        (torch.bfloat16, (4, 8), 0, 8),
    ],
    ids=["fp16-2byte", "uint8-1byte", "fp32-misaligned", "bf16-8byte"],
)
def test_triton_interpreted_word_sizes(dtype: torch.dtype, page_shape: tuple[int, ...], offset: int,
                                       word: int) -> None:
    from hybridcache.kernels.copy.triton import word_size

    num_pages, numel = 10, 1
    for size in page_shape:
        numel *= size
    storage = (torch.arange(offset + 2 * num_pages * numel) % 251).to(dtype)
    pool = storage[offset:].view(2, num_pages, *page_shape)
    assert word_size(pool, numel * pool.element_size()) == word
    expected = reference_copy(pool, [4, 4, 0], [2, 9, 1], pages_per_block=1, page_dim=1)
    head = storage[:offset].clone()
    copy_blocks(pool, torch.tensor([4, 4, 0]), torch.tensor([2, 9, 1]), pages_per_block=1, page_dim=1,
                impl="triton")
    assert torch.equal(pool, expected)
    assert torch.equal(storage[:offset], head)


@needs_interpreter
def test_triton_interpreted_multi_chunk_blocks() -> None:
    # blocks of 2 pages of 12,000 bytes: 2 chunks of 2048 words per pair, the second one masked
    pool = random_pool((2, 2, 6, 3, 1024), torch.float32, 11)[..., :1000].contiguous()
    expected = reference_copy(pool, [0, 0], [1, 2], pages_per_block=2, page_dim=2)
    copy_blocks(pool, torch.tensor([0, 0]), torch.tensor([1, 2]), pages_per_block=2, impl="triton")
    assert torch.equal(pool, expected)


@needs_interpreter
@pytest.mark.parametrize(("num_outer", "num_row_programs"), [(6, 3), (7, 1)], ids=["6rows-3progs", "7rows-1prog"])
def test_triton_interpreted_rows_per_program(num_outer: int, num_row_programs: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # pretend grid axis 1 holds at most 4 programs: each program then loops over several outer rows
    from hybridcache.kernels.copy import triton as triton_block_copy

    monkeypatch.setattr(triton_block_copy, "_MAX_GRID_1", 4)
    assert triton_block_copy._num_row_programs(num_outer) == num_row_programs
    pool = random_pool((num_outer, 8, 2, 3), torch.bfloat16, 14)
    expected = reference_copy(pool, [6, 6], [0, 3], pages_per_block=1, page_dim=1)
    copy_blocks(pool, torch.tensor([6, 6]), torch.tensor([0, 3]), pages_per_block=1, page_dim=1, impl="triton")
    assert torch.equal(pool, expected)


@needs_interpreter
def test_triton_interpreted_empty_plan() -> None:
    pool = random_pool(kv_shape(8), torch.bfloat16, 12)
    before = pool.clone()
    empty = torch.empty(0, dtype=torch.int32)
    copy_blocks(pool, empty, empty, pages_per_block=2, impl="triton")
    assert torch.equal(pool, before)


# ---- GPU ----------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("impl", ["triton", "torch", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pages_per_block", [1, 2, 4], ids=lambda n: f"ppb{n}")
def test_cuda_copy_blocks_matches_reference(impl: str, pages_per_block: int, dtype: torch.dtype) -> None:
    check_copy_blocks(impl, pages_per_block, dtype, seed=20 + pages_per_block, device="cuda")


@needs_cuda
def test_cuda_ids_on_device() -> None:
    pool = random_pool(kv_shape(16), torch.bfloat16, 13, "cuda")
    expected = reference_copy(pool, [3, 3, 0], [1, 7, 5], pages_per_block=2, page_dim=2)
    copy_blocks(pool, torch.tensor([3, 3, 0], device="cuda"), torch.tensor([1, 7, 5], device="cuda"),
                pages_per_block=2, impl="triton")
    assert torch.equal(pool, expected)
