"""The kernel variants a run-time quantity can select are few and known, so the engine compiles them all at start-up
(tests/engine/test_no_compile_after_start_up.py checks the whole engine on CUDA): checked here without a GPU."""

from __future__ import annotations

import pytest

from hybridcache.kernels.attention import triton_paged
from hybridcache.kernels.conv import triton_verify as conv_verify
from hybridcache.kernels.gated_delta import triton_gates, triton_step
from hybridcache.kernels.gated_delta import triton_verify as gdn_verify
from hybridcache.kernels.gemm import triton_block_fp8, triton_fp8_moe, triton_quant
from hybridcache.kernels.moe import triton_route, triton_sort
from hybridcache.kernels.sampling import triton_argmax


def test_every_pair_count_sorts_with_a_block_start_up_compiles():
    sizes = triton_sort.block_sizes()
    assert sizes == (16, 32, 64, 128, 256, 512, 1024)
    assert {triton_sort.block_size(n) for n in range(1, triton_sort.MAX_PAIRS + 1)} == set(sizes)


@pytest.mark.parametrize(("kernel", "count"), [
    (triton_gates._delta_gates_kernel, "num_rows"),
    (triton_route._route_kernel, "num_rows"),
    (triton_sort._sort_pairs_kernel, "num_pairs"),
    (triton_sort._sort_pairs_kernel, "top_k"),
    (triton_fp8_moe._shared_prologue_kernel, "T"),
    (triton_fp8_moe._shared_prologue_kernel, "num_pairs"),
    (triton_fp8_moe._shared_prologue_kernel, "stride_gate"),
    (triton_paged._decode_merge_kernel, "num_splits"),
    (triton_paged._prefill_split_kernel, "num_splits"),
    (triton_paged._prefill_split_kernel, "key_lo"),
    (triton_paged._prefill_split_kernel, "key_hi"),
    (triton_block_fp8._fp8_gemm_kernel, "M"),
    (triton_quant._quantize_groups_kernel, "M"),
    (triton_quant._quantize_groups_kernel, "stride_sg"),
    (gdn_verify._gdn_verify_kernel, "stride_table"),
    (conv_verify._conv_draft_states_kernel, "stride_table"),
    (triton_argmax._argmax_partial_kernel, "num_rows"),
    (triton_argmax._argmax_final_kernel, "num_rows"),
])
def test_run_time_counts_are_not_specialised(kernel, count):
    """Triton specialises an integer argument on == 1 and on divisibility by 16: a step's token, pair or split
    count would pick among three variants at run time, one of which start-up may never have met. The verify
    kernels' draft-table row stride is the step's most drafts per row (1 when every row drafts one, e.g. near
    max_tokens), which the verify graphs, captured with k drafts per row, never meet."""
    (param,) = [p for p in kernel.params if p.name == count]
    assert param.do_not_specialize


@pytest.mark.parametrize("pointer", ["g_ptr", "beta_ptr"])
def test_the_step_kernels_gate_pointers_are_not_specialised_on_alignment(pointer):
    """The DeltaNet step kernel's g and beta (the raw a and b of Qwen3-Next's projection: column views at an
    offset of 2 x (conv dim + value dim + Hv) bytes, 8 past a 16-byte boundary when Hv is 4 mod 8) came aligned in a
    piecewise-graph mixed step and not in the decode steps start-up ran: Triton's alignment specialisation compiled
    a variant while serving (tests/engine/test_no_compile_after_start_up.py on an H100)."""
    (param,) = [p for p in triton_step._gdn_step_kernel.params if p.name == pointer]
    assert param.do_not_specialize_on_alignment
