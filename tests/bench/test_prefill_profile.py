"""benchmarks/prefill_profile.py on the CPU (the H200 round runs it first): the + N request hits the cold prompt's
checkpoint, its host parts are timed (the top-level ones and the forward's inside), cProfile runs, and the JSON
is written (`--phase-a`, gpu_bench's `phase_a` on the same engine, is not run here, for time). Run as a
subprocess: the script patches the engine's methods for its timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_prefill_profile_times_a_prefix_hit_by_part(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "benchmarks" / "prefill_profile.py"), "--model", "tiny", "--device", "cpu",
               "--prefix", "2000", "--new", "200", "--scale", "0.1", "--runs", "2", "--label", "t",
               "--model-dir", str(tmp_path / "model"), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "prefill_profile_tiny_t.json").read_text())
    for mode, runs in (("free", 2), ("synced", 1)):
        timed = result[mode]
        assert len(timed["wall_ms"]) == runs and timed["cached"] == [200] * runs  # hits at the cold prompt's end
        parts = timed["parts_ms_p50"]
        for part in ("tokenise", "add_request", "schedule", "schedule: prefix match", "build inputs", "forward",
                     "forward: restore/save copies", "sample", "postprocess"):
            assert parts[part] > 0, part
        assert parts["forward"] < timed["wall_ms_p50"]
    assert result["cprofile"]["functions"] > 0 and "under cProfile" in done.stdout
    assert "kernels_compiled" in result and "Triton compiles after start-up" in done.stdout
