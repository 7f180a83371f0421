"""The gated DeltaNet kernels of the CUDA backend at head dims that are not powers of two: Olmo-Hybrid-7B's Dk 96 /
Dv 192, and smaller ones (24 / 48, 20 / 36, OLMo's own 2:1 ratio at 12 / 24) whose tiles are padded on both dims.
The step kernel (`gated_delta/triton_step.py`) and the verify kernel (`triton_verify.py`) round their tiles up to a
power of two (`triton_step.head_tiles`) and mask the lanes past the dims; fla's chunked prefill takes any Dk up to
256 and any Dv (its kernels loop over Dk / Dv in masked 32 / 64-wide blocks).

- `test_interpreted_*` run on the CPU under TRITON_INTERPRET=1, in the child process that
  `test_padded_head_dims_in_a_triton_interpreter_subprocess` starts (this process never imports triton), fp32:
  the decode step (fresh and cached sequences) with and without the gates made inside, the verify kernel in both
  modes after 150+ tokens of history, and `cuda_checks.check_head_padding`, which puts NaN in the memory every
  padded lane addresses, so a lane read unmasked shows as NaN and one written unmasked as lost padding.
- `test_cuda_*` run the same on a CUDA device (skipped without one) at the 7B's dims, bf16 and fp32, and fla's
  chunked rule there (with a mixed step's leading decode rows).
Tolerances as tests/kernels/test_cuda_kernels.py's (fp32 in another order 1e-5; bf16 outputs 1e-2 / 2e-2; fla's).
The power-of-two dims keep their tests there and in test_verify_kernels.py; test_hopper_compile.py checks that
their masks compile away.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter
from tests.kernels.test_cuda_kernels import EXACT, FLA, OURS, _interpreter_runs_our_kernels, assert_within
from tests.kernels.test_verify_kernels import _bounds

OLMO_7B = (96, 192)  # Olmo-Hybrid-7B's DeltaNet key / value head dims (30 key and 30 value heads)
OLMO_7B_CONV = 2 * 30 * 96 + 30 * 192  # its conv channels: q | k | v
PADDED = pytest.mark.parametrize("dims", [OLMO_7B, (24, 48), (20, 36), (12, 24)], ids=lambda d: f"dk{d[0]}-dv{d[1]}")
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
FP32 = OURS[torch.float32]


def padding_bounds(stats: dict) -> None:
    """`check_head_padding`'s results: fp32 errors within 1e-5 and every NaN padding entry kept."""
    kept = {name: stats.pop(name) for name in list(stats) if name.endswith("_padding_kept")}
    assert kept == {"step_padding_kept": True, "verify_padding_kept": True}
    assert_within(stats, dict.fromkeys(stats, FP32))


@pytest.mark.skipif(not _interpreter_runs_our_kernels(), reason="this Triton's interpreter cannot run our kernels")
@interpreted_in_child("interpreted")
def test_padded_head_dims_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@needs_interpreter
@PADDED
def test_interpreted_decode_step(dims: tuple[int, int]) -> None:
    from tests.kernels.cuda_checks import check_decode_step

    stats = check_decode_step(torch.float32, torch.device("cpu"), (1, 2, 17, 40), heads=(1, 2), dims=dims,
                              channels=100)
    assert_within(stats, dict.fromkeys(stats, FP32))


@needs_interpreter
@PADDED
def test_interpreted_step_kernel_makes_the_gates(dims: tuple[int, int]) -> None:
    from tests.kernels.test_fused_decode_kernels import check_step_gates

    check_step_gates(torch.float32, "cpu", exact=False, dims=dims)


@needs_interpreter
@PADDED
@pytest.mark.parametrize("states_only", [False, True], ids=["full", "states_only"])
def test_interpreted_verify(dims: tuple[int, int], states_only: bool) -> None:
    from tests.kernels.cuda_checks import check_verify

    stats = check_verify(torch.float32, torch.device("cpu"), states_only=states_only, dims=dims)
    assert_within(stats, _bounds(torch.float32, torch.float32, states_only))


@needs_interpreter
@PADDED
def test_interpreted_padded_lanes_read_and_write_nothing(dims: tuple[int, int]) -> None:
    from tests.kernels.cuda_checks import check_head_padding

    padding_bounds(check_head_padding(torch.device("cpu"), dims))


@needs_interpreter
def test_interpreted_power_of_two_dims_keep_their_padding_too() -> None:
    """The same NaN-padded layout at 32 / 64, where no lane is masked: the tiles end at the dims."""
    from tests.kernels.cuda_checks import check_head_padding

    padding_bounds(check_head_padding(torch.device("cpu"), (32, 64)))


@needs_cuda
@DTYPES
def test_cuda_decode_step_at_olmo_7b_dims(dtype: torch.dtype) -> None:
    from tests.kernels.cuda_checks import check_decode_step

    stats = check_decode_step(dtype, torch.device("cuda"), heads=(30, 30), dims=OLMO_7B, channels=OLMO_7B_CONV)
    assert_within(stats, {
        "conv_out": OURS[dtype], "conv_state": EXACT, "conv_other_slots": EXACT,
        "gdn_out": OURS[dtype], "gdn_state": FP32, "gdn_other_slots": EXACT,
    })


@needs_cuda
@DTYPES
def test_cuda_step_kernel_makes_the_gates_at_olmo_7b_dims(dtype: torch.dtype) -> None:
    from tests.kernels.test_fused_decode_kernels import check_step_gates

    check_step_gates(dtype, "cuda", exact=True, dims=OLMO_7B)


@needs_cuda
@pytest.mark.parametrize("states_only", [False, True], ids=["full", "states_only"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["state_fp32", "state_bf16"])
@DTYPES
def test_cuda_verify_at_olmo_7b_dims(dtype: torch.dtype, state_dtype: torch.dtype, states_only: bool) -> None:
    from tests.kernels.cuda_checks import check_verify

    stats = check_verify(dtype, torch.device("cuda"), states_only=states_only, state_dtype=state_dtype,
                         heads=(30, 30), dims=OLMO_7B, channels=OLMO_7B_CONV)
    assert_within(stats, _bounds(dtype, state_dtype, states_only))


@needs_cuda
@PADDED
def test_cuda_padded_lanes_read_and_write_nothing(dims: tuple[int, int]) -> None:
    from tests.kernels.cuda_checks import check_head_padding

    padding_bounds(check_head_padding(torch.device("cuda"), dims))


@needs_cuda
@DTYPES
def test_cuda_fla_chunked_rule_at_olmo_7b_dims(dtype: torch.dtype) -> None:
    """fla's chunked prefill (Dk 96: two 64-row blocks of its state kernel, the second half masked; Dv 192: three
    64-wide or six 32-wide column blocks) and a mixed step's leading decode rows in the step kernel."""
    from tests.kernels.cuda_checks import check_gated_delta

    cuda = torch.device("cuda")
    for lengths, history in (((1, 17, 63, 64, 65, 200), (0, 5, 100, 64, 0, 37)),
                             ((1, 1, 1, 17, 200), (40, 0, 7, 5, 37))):
        stats = check_gated_delta(dtype, cuda, lengths=lengths, history=history, heads=(4, 4), dims=OLMO_7B)
        assert_within(stats, {"out": FLA[dtype], "final_state": FLA[dtype], "other_slots": EXACT})
