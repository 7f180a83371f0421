"""Workloads for the simulator and the engine benchmark: loaders for the real traces in
`<repo>/../shared/traces/` and generators for the shapes they lack. See base.py for the request model.

| name               | source                                   | shape                                       |
| ------------------ | ---------------------------------------- | ------------------------------------------- |
| `sharegpt`         | ShareGPT V3 multi-turn chats             | sessions; a turn's prompt is the history    |
| `mooncake`         | Mooncake conversation trace (Kimi)       | 512-token block hashes, timestamps          |
| `swe-agent`        | SWE-agent trajectories                   | agent sessions; prompts grow by tool output |
| `shared-prefix`    | generated                                | G system prompts x M questions              |
| `group-sampling`   | generated                                | P prompts x n samples, n separate requests  |
| `group-sampling-n` | generated                                | P prompts, one request with `n` each        |

Every workload is deterministic given `seed` and can be cut to `num_requests` requests (the first in arrival
order) or, for chat workloads, `num_sessions` sessions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridcache.bench.workloads.base import (
    ChatSession,
    ChatTurn,
    SimRequest,
    Workload,
    chat_workload,
    truncate_sessions,
)
from hybridcache.bench.workloads.mooncake import mooncake_workload
from hybridcache.bench.workloads.sharegpt import load_sharegpt
from hybridcache.bench.workloads.swe_agent import load_swe_agent
from hybridcache.bench.workloads.synthetic import group_sampling_workload, shared_prefix_workload
from hybridcache.bench.workloads.text import ChatEncoder

__all__ = [
    "WORKLOAD_NAMES",
    "ChatEncoder",
    "ChatOptions",
    "ChatSession",
    "ChatTurn",
    "SimRequest",
    "Workload",
    "default_trace_path",
    "load_workload",
]

_TRACES = {
    "sharegpt": "sharegpt/sharegpt_v3_sample1000.part0.jsonl",
    "mooncake": "mooncake/conversation_trace.jsonl",
    "swe-agent": "swe_agent/trajectories",
}
WORKLOAD_NAMES = ("sharegpt", "mooncake", "swe-agent", "shared-prefix", "group-sampling", "group-sampling-n")


@dataclass(frozen=True)
class ChatOptions:
    """Cuts for the chat workloads (None = no cut): sessions, model calls per session, characters per
    message, prompt tokens (a session ends at the first call whose prompt + reply would exceed it)."""

    num_sessions: int | None = None
    max_turns: int | None = None
    max_message_chars: int | None = None
    max_prompt_len: int | None = None


def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def default_trace_path(name: str) -> Path:
    """`<repo>/../shared/traces/<file>` for a trace workload (a ValueError for generated ones)."""
    if name not in _TRACES:
        raise ValueError(f"workload {name!r} reads no trace")
    return repo_root().parent / "shared" / "traces" / _TRACES[name]


def load_workload(
    name: str,
    *,
    trace: str | Path | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    model_dir: str | Path | None = None,
    vocab: int = 256,
    chat: ChatOptions | None = None,
) -> Workload:
    """The workload `name` (see the module table). `model_dir` picks the tokenizer and chat template of
    the chat workloads (None: the built-in model's); `vocab` bounds the generated token ids."""
    if name not in WORKLOAD_NAMES:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOAD_NAMES)}")
    if name in _TRACES:
        path = Path(trace) if trace is not None else default_trace_path(name)
        if not path.exists():
            raise FileNotFoundError(f"trace for {name!r} not found at {path} (pass --trace)")
    if name == "mooncake":
        return mooncake_workload(path, seed=seed, num_requests=num_requests, vocab=vocab)
    if name == "shared-prefix":
        return shared_prefix_workload(seed=seed, vocab=vocab, num_requests=num_requests)
    if name in ("group-sampling", "group-sampling-n"):
        return group_sampling_workload(seed=seed, vocab=vocab, as_n=name.endswith("-n"), num_requests=num_requests)
    chat = chat or ChatOptions()
    encoder = ChatEncoder(model_dir)
    if name == "sharegpt":
        sessions = load_sharegpt(path, encoder, seed=seed, num_sessions=chat.num_sessions, max_turns=chat.max_turns,
                                 max_message_chars=chat.max_message_chars, max_prompt_len=chat.max_prompt_len)
    else:
        sessions = load_swe_agent(path, encoder, seed=seed, num_sessions=chat.num_sessions,
                                  max_message_chars=chat.max_message_chars, max_prompt_len=chat.max_prompt_len)
    if num_requests is not None:
        sessions = truncate_sessions(sessions, num_requests)
    return chat_workload(name, sessions)
