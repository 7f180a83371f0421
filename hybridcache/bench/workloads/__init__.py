"""Workloads for the simulator and the engine benchmark: loaders for real traces and generators for the
shapes they lack. See base.py for the request model.

Slices of the SWE-agent and Mooncake traces ship inside the package (`hybridcache/bench/traces/`, each with
its licence) and are read by default; `trace=` (CLI `--trace`) reads a full or other copy. ShareGPT is not
shipped (its redistribution terms are unclear): `sharegpt` needs `trace=`.

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
    "TRACE_WORKLOADS",
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

TRACE_WORKLOADS = ("sharegpt", "mooncake", "swe-agent")
_SHIPPED_TRACES = {
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


def shipped_traces_dir() -> Path:
    """The folder of the trace slices shipped as package data."""
    return Path(__file__).resolve().parent.parent / "traces"


def default_trace_path(name: str) -> Path:
    """The shipped slice of a trace workload's trace. A ValueError for generated workloads and for
    `sharegpt`, which ships no slice (pass its file with `trace=` / `--trace`)."""
    if name not in TRACE_WORKLOADS:
        raise ValueError(f"workload {name!r} reads no trace")
    if name not in _SHIPPED_TRACES:
        raise ValueError(f"workload {name!r} ships no trace (its redistribution terms are unclear): pass a "
                         f"ShareGPT V3 .jsonl file with --trace")
    return shipped_traces_dir() / _SHIPPED_TRACES[name]


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
    the chat workloads (None: the built-in model's); `vocab` bounds the generated token ids. A ValueError for a
    `trace` given to a generated workload and for a workload left with no requests (an empty trace, cuts that
    leave nothing)."""
    if name not in WORKLOAD_NAMES:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOAD_NAMES)}")
    if trace is not None and name not in TRACE_WORKLOADS:
        raise ValueError(f"--trace {str(trace)!r}: workload {name!r} is generated and reads no trace (the trace "
                         f"workloads are {', '.join(TRACE_WORKLOADS)})")
    workload = _load(name, trace, num_requests, seed, model_dir, vocab, chat)
    if len(workload) == 0:
        raise ValueError(f"the workload {name!r} has no requests" + (
            " (its trace holds none)" if name == "mooncake" else
            " (an empty trace, or --max-prompt-len / --max-turns / --num-sessions cut every call)"
            if name in TRACE_WORKLOADS else ""))
    return workload


def _load(name: str, trace: str | Path | None, num_requests: int | None, seed: int, model_dir: str | Path | None,
          vocab: int, chat: ChatOptions | None) -> Workload:
    """`load_workload` before its checks of the result."""
    if name in TRACE_WORKLOADS:
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
        sessions = load_swe_agent(path, encoder, seed=seed, num_sessions=chat.num_sessions, max_turns=chat.max_turns,
                                  max_message_chars=chat.max_message_chars, max_prompt_len=chat.max_prompt_len)
    if num_requests is not None:
        sessions = truncate_sessions(sessions, num_requests)
    return chat_workload(name, sessions)
