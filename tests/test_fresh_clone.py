"""A fresh clone, alone in an empty folder, runs Quickstart 1 to its result table (installs a .venv: slow)."""

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_fresh_clone_runs_quickstart_1_to_its_table():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout")
    result = subprocess.run(["bash", str(REPO / "scripts" / "fresh_clone_check.sh")], capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "TTFT p50 ms" in out and "hybridcache" in out
    assert "greedy outputs identical across modes: yes" in out
    assert "quickstart 1 took" in out
