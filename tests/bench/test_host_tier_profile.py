"""benchmarks/host_tier_profile.py on the CPU (the H200 round runs it first): both engines run phase A's traffic,
the profiled `hit` request really comes from the host with the tier and is recomputed without it, and the
comparison, the parts and the host pool's direct timings are written. Run as a subprocess: the script hooks the
sampler's class for its timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_host_tier_profile_runs_a_host_hit_against_its_recompute(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "benchmarks" / "host_tier_profile.py"), "--model", "tiny-state50",
               "--device", "cpu", "--stub-forward", "--scale", "0.25", "--num-blocks", "300", "--max-model-len",
               "4096", "--host-cache-gib", "0.25", "--turns", "2", "--ch", "1", "--traces", "0", "--model-dir",
               str(tmp_path / "model"), "--out", str(out), "--rows", "5"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "host_tier_profile_tiny-state50.json").read_text())
    tier, none = result["tier"], result["none"]
    for engine in (tier, none):
        assert engine["phase_a"]["requests"] == 32
        profiled = engine["profiled"]
        assert set(profiled) == {"hit", "fresh"} and all(profiled[kind]["ops"] for kind in ("hit", "fresh"))
        assert {"schedule", "launch", "host copies", "wait", "gc"} <= set(profiled["hit"]["request"]["parts_ms"])
    assert tier["phase_a"]["host"]["num_demoted_checkpoints"] > 0 and "num_host_hits" in tier["phase_a"]["host"]
    hit_with, hit_without = tier["profiled"]["hit"]["request"], none["profiled"]["hit"]["request"]
    assert hit_with["host"]["num_host_hits"] == 1 and hit_with["cached"] > 0  # the tier's hit is a host hit
    assert hit_without["cached"] == 0 and hit_with["prompt"] == hit_without["prompt"]  # the same prompt, recomputed
    assert tier["ch"][0]["warm"]["host"]["num_host_hits"] == 1 and none["ch"][0]["warm"]["cached"] == 0
    copies = tier["pool_copies"]
    assert copies["pinned"] is False and copies["blocks_per_copy"] == 128
    assert all(copies[f"{kind} ({layout})"]["total_ms"] > 0 for kind in ("save", "load")
               for layout in ("one run", "a run per block"))
    assert {row["op"] for row in result["compare"]["hit"]} >= {"aten::copy_"}
    text = (out / "host_tier_profile_tiny-state50.txt").read_text()
    assert "### `hit` request" in text and "host pool: pinned False" in text
