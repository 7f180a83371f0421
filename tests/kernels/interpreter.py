"""Run a test file's interpreted kernel tests in a child process under `TRITON_INTERPRET=1`.

Triton reads `TRITON_INTERPRET` when it is imported, so a test session that has already imported it cannot switch
to the interpreter: the kernel test files each keep one parent test that calls `run_interpreted` with a `-k`
selector matching only their interpreted tests (never the parent itself: a child that ran it would spawn children
without end). The markers every kernel test file uses live here too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # (in the child process of `run_interpreted`)
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def run_interpreted(test_file: str, selector: str, timeout: float = 600) -> None:
    """Run `pytest -k selector test_file` with the Triton interpreter on; fail unless it passed and skipped
    nothing."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(test_file)), "-k", selector]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]
