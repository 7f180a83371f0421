"""benchmarks/host_tier_returns.py on a generated workload: every demotion of the replay is recorded (as many as
the cache counts), the returns are a subset of them, and each table's shares are those of the recorded rows. Run as
a subprocess, as the script is run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from hybridcache.bench.replay import cache_requests_of
from hybridcache.bench.simulator import GIB, SimConfig, make_replay, parse_policies
from hybridcache.bench.workloads import load_workload
from hybridcache.engine.cost_model import load_model_cost

ROOT = Path(__file__).resolve().parents[2]
GPU_GIB, BLOCK = 0.002, 16


def test_every_demotion_is_recorded_with_its_future():
    command = [sys.executable, str(ROOT / "benchmarks" / "host_tier_returns.py"), "--workload", "shared-prefix",
               "--num-requests", "200", "--gib", str(GPU_GIB), "--block-size", str(BLOCK)]
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    head = re.search(r"([\d,]+) checkpoints demoted, ([\d,]+) used by a later request", done.stdout)
    demoted, back = (int(g.replace(",", "")) for g in head.groups())

    requests = list(load_workload("shared-prefix", num_requests=200))
    (hybrid,) = parse_policies("hybridcache", BLOCK)
    gpu = int(GPU_GIB * GIB)
    replay = make_replay(hybrid, load_model_cost(None, "auto"), SimConfig(gpu, BLOCK, host_memory_bytes=4 * gpu))
    for request in requests:
        replay.run(request, cache_requests_of(request))
    assert demoted == replay.cache.stats.num_demoted_checkpoints > 0
    assert 0 < back < demoted  # a shared system prompt's branch points return, its turn ends do not

    first = done.stdout.split("\n\n")[1]  # why it was saved, hit before, shadowed: one row per kind
    rows = [line.split(" | ") for line in first.splitlines() if line.startswith("| (")]
    counts = [int(row[1].replace(",", "")) for row in rows]
    shares = [float(row[2].rstrip(" |")) for row in rows]
    assert sum(counts) == demoted and all(0 <= s <= 1 for s in shares)
    returned = sum(n * s for n, s in zip(counts, shares, strict=True))  # the shares are rounded to 0.01
    assert abs(returned - back) <= 0.005 * demoted + 1e-9
