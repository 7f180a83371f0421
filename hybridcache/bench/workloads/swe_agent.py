"""`swe-agent`: SWE-agent trajectories (`*.traj` JSON); each assistant message of `history` is one model
call whose prompt is every message before it (rendered with the chat template): system, user, assistant and tool
messages (the function-calling agents' observations come as role "tool"). An assistant message's `tool_calls`
(the function-calling agents' actions) are rendered by the template and are part of its reply.

Runs are sessions in sorted path order; they start `session_gap_s` apart (seeded exponential gaps) and a
run's next call follows after an exponential tool time of mean `think_s`, so concurrent agents interleave.
Message content that is a list of parts (`{"type": "text", "text": ...}`) is joined.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hybridcache.bench.workloads.base import ChatSession, session_arrivals
from hybridcache.bench.workloads.records import items_of, json_file
from hybridcache.bench.workloads.text import ChatEncoder


def _text(content) -> str:
    if content is None:  # (an assistant message that only calls tools: OpenAI's null content)
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


_ROLES = ("system", "user", "assistant", "tool")


def _message(m: dict, max_chars: int | None) -> dict:
    """A history message as the chat template takes it: role, content (cut to `max_chars`), tool calls."""
    message = {"role": m["role"], "content": _text(m.get("content", ""))[:max_chars]}
    if m["role"] == "assistant" and isinstance(m.get("tool_calls"), list) and m["tool_calls"]:
        message["tool_calls"] = m["tool_calls"]
    return message


def trajectory_files(path: str | Path) -> list[Path]:
    """A `.traj` file, or every `.traj` file under a folder (sorted)."""
    path = Path(path)
    return [path] if path.is_file() else sorted(path.rglob("*.traj"))


def load_swe_agent(
    path: str | Path,
    encoder: ChatEncoder,
    *,
    seed: int = 0,
    num_sessions: int | None = None,
    max_turns: int | None = None,
    max_message_chars: int | None = None,
    max_prompt_len: int | None = None,
    session_gap_s: float = 5.0,
    think_s: float = 5.0,
) -> tuple[ChatSession, ...]:
    """One session per trajectory (see the module docstring), cut to `max_turns` model calls."""
    files = trajectory_files(path)
    if not files:
        raise FileNotFoundError(f"no .traj files under {path}")
    rng = np.random.default_rng(seed)
    sessions = []
    start = 0.0
    for file in files:
        if num_sessions is not None and len(sessions) >= num_sessions:
            break
        trajectory = json_file(file)
        if not isinstance(trajectory, dict):
            raise ValueError(f"{file}:1: expected a trajectory object, got {type(trajectory).__name__}")
        history = items_of(trajectory, "history", f"{file}:1") if "history" in trajectory else []
        messages = [_message(m, max_message_chars) for m in history if isinstance(m, dict) and m.get("role") in _ROLES]
        calls = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
        if max_turns is not None and len(calls) > max_turns:
            messages = messages[: calls[max_turns - 1] + 1]
        num_calls = sum(m["role"] == "assistant" for m in messages)
        arrivals = session_arrivals(num_calls, start, rng, think_s)
        start += float(rng.exponential(session_gap_s))
        name = file.relative_to(path).with_suffix("").as_posix() if Path(path).is_dir() else file.stem
        session = encoder.session(f"swe-{name}", messages, arrivals, max_prompt_len)
        if session is not None:
            sessions.append(session)
    return tuple(sessions)
