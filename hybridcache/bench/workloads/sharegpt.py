"""`sharegpt`: multi-turn chats from the ShareGPT V3 file, rendered with the model's chat template.

Each line (or each element of a file that is one JSON array, as the V3 download has it) is
`{"id", "conversations": [{"from": "human"|"gpt", "value": text}, ...]}`. Leading assistant
messages are dropped (they have nothing before them); turn k's prompt is every message before the k-th
assistant reply, with the generation prompt. Sessions arrive as a Poisson process (mean `session_gap_s`)
and a session's next call follows after an exponential think time (mean `think_s`), both seeded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hybridcache.bench.workloads.base import ChatSession, session_arrivals
from hybridcache.bench.workloads.records import items_of, json_records
from hybridcache.bench.workloads.text import ChatEncoder

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
          "system": "system"}


def read_conversations(path: str | Path) -> list[tuple[str, list[dict]]]:
    """(id, messages) per record (one JSON object per line, or one JSON array of them as the ShareGPT V3 download
    has it), roles mapped to user/assistant/system, leading assistant messages dropped; conversations left
    without a user message before an assistant message are skipped. Ids are unique: a record without one is
    named by its position among those kept, a repeated one (two records of one id) gets `~2`, `~3`, ...
    A record that is not an object with a list of message objects under `conversations` is a ValueError
    `"{path}:{line}: ..."`."""
    out = []
    used: set[str] = set()
    for where, record in json_records(path):
        turns = items_of(record, "conversations", where)
        if not all(isinstance(m, dict) for m in turns):
            raise ValueError(f"{where}: 'conversations' must hold message objects ({{\"from\", \"value\"}})")
        messages = [
            {"role": _ROLES[m["from"]], "content": m["value"]}
            for m in turns
            if m.get("from") in _ROLES and isinstance(m.get("value"), str)
        ]
        while messages and messages[0]["role"] == "assistant":
            messages.pop(0)
        if any(m["role"] == "assistant" for m in messages):
            out.append((_unique(str(record.get("id", len(out))), used), messages))
    return out


def _unique(conv_id: str, used: set[str]) -> str:
    """`conv_id`, or `conv_id~K` for the first K >= 2 not in `used` when it is; added to `used`."""
    candidate, k = conv_id, 1
    while candidate in used:
        k += 1
        candidate = f"{conv_id}~{k}"
    used.add(candidate)
    return candidate


def load_sharegpt(
    path: str | Path,
    encoder: ChatEncoder,
    *,
    seed: int = 0,
    num_sessions: int | None = None,
    max_turns: int | None = None,
    max_message_chars: int | None = None,
    max_prompt_len: int | None = None,
    session_gap_s: float = 2.0,
    think_s: float = 30.0,
) -> tuple[ChatSession, ...]:
    """Sessions of the file, in file order, cut to `num_sessions`, `max_turns` model calls each, messages cut
    to `max_message_chars` characters and prompts to `max_prompt_len` tokens (see `ChatEncoder.session`)."""
    rng = np.random.default_rng(seed)
    sessions = []
    start = 0.0
    for conv_id, messages in read_conversations(path):
        if num_sessions is not None and len(sessions) >= num_sessions:
            break
        if max_message_chars is not None:
            messages = [{**m, "content": m["content"][:max_message_chars]} for m in messages]
        if max_turns is not None:
            calls = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
            if len(calls) > max_turns:
                messages = messages[: calls[max_turns - 1] + 1]
        num_calls = sum(m["role"] == "assistant" for m in messages)
        arrivals = session_arrivals(num_calls, start, rng, think_s)
        start += float(rng.exponential(session_gap_s))
        session = encoder.session(f"sharegpt-{conv_id}", messages, arrivals, max_prompt_len)
        if session is not None:
            sessions.append(session)
    return tuple(sessions)
