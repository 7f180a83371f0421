"""The speculative-decoding verify kernels (`gated_delta/triton_verify.py`, `conv/triton_verify.py`) against the
torch references (`gated_delta_rule_verify`, `conv_states_after`) via `tests/kernels/cuda_checks.check_verify`:
decode and verify rows (0-3 drafts) after 150+ tokens of real recurrent history, a fresh row, and in states-only
mode a prefill chunk beside them.

- `test_cuda_*` run on a CUDA device (skipped without one), model dtypes bf16 and fp32, state fp32 and bf16.
- `test_interpreted_*` run on the CPU under TRITON_INTERPRET=1, in the child process that
  `test_verify_interpreter_in_subprocess` starts (this process never imports triton); fp32 only (the interpreter's
  bf16 arithmetic is wrong).

Tolerances (see tests/kernels/test_cuda_kernels.py): fp32 arithmetic in another order 1e-5; bf16 outputs rounded
once 1e-2 / 2e-2 (norm_rel / max_rel); states kept in bf16 are rounded after each position like the reference's,
so they agree to one bf16 step (2^-8) where the two fp32 orders round apart; conv states are copies: exact; every
other pool row: exact (untouched).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels.test_cuda_kernels import EXACT, OURS, _interpreter_runs_our_kernels, assert_within

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
REPO_ROOT = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child of test_verify_interpreter_in_subprocess"
)
MODES = pytest.mark.parametrize("states_only", [False, True], ids=["full", "states_only"])
BF16_STATE = (8e-3, 8e-3)


def _bounds(dtype: torch.dtype, state_dtype: torch.dtype, states_only: bool) -> dict:
    state = OURS[torch.float32] if state_dtype == torch.float32 else BF16_STATE
    bounds = {"draft_states": state, "conv_draft_states": EXACT, "other_rows": EXACT, "conv_other_rows": EXACT}
    if not states_only:
        bounds["out"] = OURS[dtype]
    return bounds


@needs_cuda
@MODES
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["state_fp32", "state_bf16"])
def test_cuda_verify(dtype: torch.dtype, state_dtype: torch.dtype, states_only: bool) -> None:
    from tests.kernels.cuda_checks import check_verify

    stats = check_verify(dtype, torch.device("cuda"), states_only=states_only, state_dtype=state_dtype,
                         heads=(16, 32), dims=(128, 128), channels=8192)
    assert_within(stats, _bounds(dtype, state_dtype, states_only))


@pytest.mark.skipif(not _interpreter_runs_our_kernels(), reason="this Triton's interpreter cannot run our kernels")
def test_verify_interpreter_in_subprocess() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
               "-k", "interpreted"]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]


@needs_interpreter
@MODES
def test_interpreted_verify(states_only: bool) -> None:
    from tests.kernels.cuda_checks import check_verify

    stats = check_verify(torch.float32, torch.device("cpu"), states_only=states_only)
    assert_within(stats, _bounds(torch.float32, torch.float32, states_only))


@needs_interpreter
def test_interpreted_verify_bf16_state() -> None:
    """A bf16 state pool, rounded after every position. The interpreter emulates bf16 by truncation (twice the
    hardware's rounding step, and biased), so the states and the outputs read through them get 2.5x the GPU bounds."""
    from tests.kernels.cuda_checks import check_verify

    stats = check_verify(torch.float32, torch.device("cpu"), states_only=False, state_dtype=torch.bfloat16)
    bounds = _bounds(torch.float32, torch.bfloat16, False)
    assert_within(stats, {**bounds, "draft_states": (2e-2, 2e-2), "out": (2e-2, 2e-2)})


@needs_interpreter
def test_interpreted_verify_refuses_bad_shapes() -> None:
    from hybridcache.kernels.gated_delta.triton_verify import gated_delta_rule_verify

    q = torch.zeros(3, 1, 16)
    v = torch.zeros(3, 2, 24)  # Dv not a power of two
    g = torch.zeros(3, 2)
    pool = torch.zeros(4, 2, 16, 24)
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="powers of two"):
        gated_delta_rule_verify(q, q, v, g, g, pool, one, torch.tensor([0, 3]), one, torch.zeros(1, 1).long(),
                                torch.zeros(1, dtype=torch.int32), states_only=False)
