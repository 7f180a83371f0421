"""benchmarks/host_tier_belady.py: `BeladyHostOrder` drops what is never used again first (the largest first), then
what is used furthest in the future, skips pinned checkpoints and looks again once the replay has passed a next
use; the script runs every variant on a generated workload (as a subprocess, as it is run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from host_tier_belady import VARIANTS, BeladyHostOrder  # noqa: E402  (a script beside the package)
from host_tier_bound import Seen  # noqa: E402


class _Future:
    """next_use by anchor hash: a list of request indices that use it."""

    def __init__(self, uses: dict[int, list[int]]) -> None:
        self.uses = uses

    def next_use(self, prefix_hash, depth, tail, after):
        return next((j for j in self.uses.get(prefix_hash, ()) if j > after), None)


def _ckpt(cid: int, anchor_hash: int, num_pages: int = 2) -> SimpleNamespace:
    return SimpleNamespace(ckpt_id=cid, anchor=SimpleNamespace(hash=anchor_hash, depth=1), tail_ids=(),
                           pages=tuple(range(num_pages)), frozen_block=None, num_pins=0)


def test_belady_drops_the_never_used_largest_first_then_the_furthest():
    seen = Seen()
    seen.now = 0
    order = BeladyHostOrder(100, _Future({1: [5], 2: [9], 3: [], 4: []}), seen)
    soon, late, never_small, never_big = _ckpt(1, 1), _ckpt(2, 2), _ckpt(3, 3, 2), _ckpt(4, 4, 3)
    for ckpt in (soon, late, never_small, never_big):
        order.add(ckpt, proven=False)
    assert order.victim() is never_big
    never_big.num_pins = 1  # pinned: skipped, and still there once unpinned
    assert order.victim() is never_small
    order.remove(never_small)
    never_big.num_pins = 0
    assert order.victim() is never_big
    order.remove(never_big)
    assert order.victim() is late
    order.remove(late)
    assert order.victim() is soon


def test_a_passed_next_use_is_looked_up_again():
    seen = Seen()
    seen.now = 0
    order = BeladyHostOrder(100, _Future({1: [3, 50], 2: [20]}), seen)
    a, b = _ckpt(1, 1), _ckpt(2, 2)
    order.add(a, proven=False)
    order.add(b, proven=False)
    assert order.victim() is b  # a at 3, b at 20
    seen.now = 3  # a's use has come: its next is 50
    assert order.victim() is a


def test_the_script_runs_every_variant(tmp_path):
    out = tmp_path / "belady.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "host_tier_belady.py"), "--workload", "shared-prefix",
               "--num-requests", "150", "--gib", "0.002", "--block-size", "16", "--variants", ",".join(VARIANTS),
               "--json", str(out)]
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["variant"] for row in rows] == list(VARIANTS)
    assert all(0 <= row["hit_rate"] <= 1 for row in rows)


def test_without_timing_the_never_used_go_first_then_the_default_order():
    seen = Seen()
    seen.now = 0
    order = BeladyHostOrder(100, _Future({1: [5], 2: [9], 3: []}), seen, timing=False)
    first, second, never = _ckpt(1, 1), _ckpt(2, 2), _ckpt(3, 3)
    order.add(first, proven=False)
    order.tick(10)
    order.add(second, proven=False)
    order.add(never, proven=True)
    assert order.victim() is never
    order.remove(never)
    assert order.victim() is first  # due first (Belady would take `second`, used later)


def test_a_predictor_of_accuracy_zero_gets_every_checkpoint_wrong():
    seen = Seen()
    seen.now = 0
    order = BeladyHostOrder(100, _Future({1: [5], 2: []}), seen, timing=False, accuracy=0.0)
    used, never = _ckpt(1, 1), _ckpt(2, 2)
    order.add(used, proven=False)
    order.add(never, proven=False)
    assert order.victim() is used  # believed never used again
