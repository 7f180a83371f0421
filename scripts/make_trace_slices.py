"""Cut the trace slices shipped in `hybridcache/bench/traces/` from full copies of the public traces.

Usage: python scripts/make_trace_slices.py SOURCE_DIR
SOURCE_DIR holds `mooncake/conversation_trace.jsonl` (+ LICENSE-APACHE) and/or `swe_agent/trajectories/`
(+ LICENSE); a part whose source is absent is left as shipped. The slices are what the main job
(`hybridcache bench`) and the tests read by default:

- mooncake: the first MOONCAKE_LINES requests of the conversation trace, lines unchanged.
- swe-agent: every trajectory, its `history` only (each message's role, agent, content, and the function calls
  of an assistant message (`tool_calls`) and the ids they answer of a tool message (`tool_call_ids`), where
  present; the environment, per-step trajectory and info records are dropped; content is not cut).

The SWE-agent slice was cut from SWE-agent's `trajectories/demonstrations` at commit 3ea751c (the folder last
changed in 6496ddd, 2024-12-04).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

MOONCAKE_LINES = 1000
SWE_AGENT_KEYS = ("role", "agent", "content", "tool_calls", "tool_call_ids")
OUT = Path(__file__).resolve().parent.parent / "hybridcache" / "bench" / "traces"


def cut_mooncake(source: Path) -> None:
    mooncake = OUT / "mooncake"
    mooncake.mkdir(parents=True, exist_ok=True)
    with open(source / "conversation_trace.jsonl", encoding="utf-8") as f:
        lines = [line for _, line in zip(range(MOONCAKE_LINES), f)]
    (mooncake / "conversation_trace.jsonl").write_text("".join(lines), encoding="utf-8")
    shutil.copyfile(source / "LICENSE-APACHE", mooncake / "LICENSE-APACHE")


def cut_swe_agent(source: Path) -> None:
    swe = OUT / "swe_agent"
    src = source / "trajectories"
    for file in sorted(src.rglob("*.traj")):
        history = json.loads(file.read_text(encoding="utf-8")).get("history", [])
        kept = [{k: m[k] for k in SWE_AGENT_KEYS if k in m} for m in history]
        target = swe / "trajectories" / file.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps({"history": kept}, ensure_ascii=False) + "\n", encoding="utf-8")
    shutil.copyfile(source / "LICENSE", swe / "LICENSE")


def main(source: Path) -> None:
    parts = {"mooncake": cut_mooncake, "swe_agent": cut_swe_agent}
    for name, cut in parts.items():
        if (source / name).is_dir():
            cut(source / name)
            print(f"cut {name} from {source / name}")
        else:
            print(f"{source / name} is absent: the shipped {name} slice is left as it is")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
