"""Cut the trace slices shipped in `hybridcache/bench/traces/` from full copies of the public traces.

Usage: python scripts/make_trace_slices.py SOURCE_DIR
SOURCE_DIR holds `mooncake/conversation_trace.jsonl` (+ LICENSE-APACHE) and `swe_agent/trajectories/`
(+ LICENSE). The slices are what the main job (`hybridcache bench`) and the tests read by default:

- mooncake: the first MOONCAKE_LINES requests of the conversation trace, lines unchanged.
- swe-agent: every trajectory, its `history` only (each message's role, agent and content; the
  environment, per-step trajectory and info records are dropped; content is not cut).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

MOONCAKE_LINES = 1000
OUT = Path(__file__).resolve().parent.parent / "hybridcache" / "bench" / "traces"


def main(source: Path) -> None:
    mooncake = OUT / "mooncake"
    mooncake.mkdir(parents=True, exist_ok=True)
    with open(source / "mooncake" / "conversation_trace.jsonl", encoding="utf-8") as f:
        lines = [line for _, line in zip(range(MOONCAKE_LINES), f)]
    (mooncake / "conversation_trace.jsonl").write_text("".join(lines), encoding="utf-8")
    shutil.copyfile(source / "mooncake" / "LICENSE-APACHE", mooncake / "LICENSE-APACHE")

    swe = OUT / "swe_agent"
    src = source / "swe_agent" / "trajectories"
    for file in sorted(src.rglob("*.traj")):
        history = json.loads(file.read_text(encoding="utf-8")).get("history", [])
        kept = [{k: m[k] for k in ("role", "agent", "content") if k in m} for m in history]
        target = swe / "trajectories" / file.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({"history": kept}, ensure_ascii=False) + "\n", encoding="utf-8")
    shutil.copyfile(source / "swe_agent" / "LICENSE", swe / "LICENSE")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
