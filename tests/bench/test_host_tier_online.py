"""benchmarks/host_tier_online.py on a generated workload: every screened rule runs, and `default` is the host
tier as built (the same hit rate as `host_tier_belady.py`'s default). Run as a subprocess, as it is run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *extra: str) -> str:
    command = [sys.executable, str(ROOT / "benchmarks" / script), "--workload", "shared-prefix", "--num-requests",
               "150", "--gib", "0.002", "--block-size", "16", *extra]
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_every_rule_runs_and_the_default_is_the_tier_as_built():
    out = _run("host_tier_online.py")
    rates = dict(re.findall(r"^\| ([\w-]+) \| ([\d.]+) \|", out, re.M))
    assert set(rates) == {"default", "gap", "gap-due", "cont", "gap-chunk", "reads", "passed"}
    assert all(0 <= float(v) <= 1 for v in rates.values())
    built = re.search(r"^\| default \| ([\d.]+) \|", _run("host_tier_belady.py", "--variants", "default"), re.M)
    assert built.group(1) == rates["default"]
