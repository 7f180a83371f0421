"""benchmarks/host_tier_bound.py on a generated workload: its class table counts every demotion of the default
replay, the rule that releases and protects nothing more than the default reproduces the default's hit rate, and
every rule's row reaches the JSON. Run as a subprocess, as the script is run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_bound_replays_the_default_and_every_rule(tmp_path):
    out = tmp_path / "bound.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "host_tier_bound.py"), "--workload", "shared-prefix",
               "--num-requests", "150", "--gib", "0.002", "--block-size", "16", "--json", str(out)]
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for kind in ("coarse", "fine"):
        head = re.search(rf"{kind} classes: (\d+), ([\d,]+) demotions; the default order: hit rate ([\d.]+)",
                         done.stdout)
        demotions, default = int(head.group(2).replace(",", "")), float(head.group(3))
        assert demotions > 0 and 0 < default < 1
        if kind == "coarse":
            table = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ('")]
            assert sum(int(row[1].replace(",", "")) for row in table) == demotions
        same = re.search(rf"\| {kind} \| 0 \| - \| ([\d.]+) \|", done.stdout)
        assert float(same.group(1)) == default  # demote every class, protect none beyond a hit: the default order
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 12 and all(0 <= row["hit_rate"] <= 1 for row in rows)
