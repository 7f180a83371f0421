"""What every workload yields: token-level requests, and chat sessions whose turns build on each other.

A `SimRequest` is one model call as the cache sees it: a prompt and the tokens the model emits. The cache
is fed `prompt_ids + output_ids[:-1]` (the last emitted token is sampled but never fed).

A `ChatSession` is a conversation at the token level, so that a turn's prompt is exactly the previous
prompt, the previous reply and the chat template's tokens that follow it (a client that keeps the history
as token ids; byte-level tokens do not survive a text round trip)::

    prompt_0     = first_prompt_ids
    prompt_{k+1} = prompt_k + reply_k + turns[k].after_ids

    recorded replies (the simulator):  reply_k = turns[k].reply_ids + after_ids[:1]  (the end-of-turn token
                                       is the model's last output: sampled, not fed)
                                       prompt_{k+1} = prompt_k + turns[k].reply_ids + turns[k].after_ids
    generated replies (engine bench):  reply_k = the generated ids; prompt_{k+1} = prompt_k + generated +
                                       turns[k].after_ids

`after_ids` of turn k holds the template's end of the assistant message, the messages that arrive before
the next model call (user message, tool output) and the next generation prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SimRequest:
    """One model call: `n` completions of `prompt_ids`, each emitting `output_ids` (len >= 1).

    session_id / turn   which conversation it belongs to and its index there (0 for single calls).
    arrival_s           when it arrives (seconds since the start of the trace).
    sibling_output_ids  for n > 1, the outputs of completions 1 .. n-1 (completion 0 emits `output_ids`).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    arrival_s: float = 0.0
    session_id: str = ""
    turn: int = 0
    n: int = 1
    sibling_output_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt_ids or not self.output_ids:
            raise ValueError(f"request {self.request_id}: prompt and output need at least one token")
        if len(self.sibling_output_ids) != self.n - 1:
            raise ValueError(f"request {self.request_id}: n={self.n} needs {self.n - 1} sibling outputs")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def outputs(self) -> tuple[tuple[int, ...], ...]:
        """The output of every completion, completion 0 first."""
        return (self.output_ids, *self.sibling_output_ids)


@dataclass(frozen=True)
class ChatTurn:
    """One model call of a session after the first prompt: see the module docstring."""

    reply_ids: tuple[int, ...]
    after_ids: tuple[int, ...]


@dataclass(frozen=True)
class ChatSession:
    """A conversation at the token level; `arrivals_s[k]` is when model call k arrives."""

    session_id: str
    first_prompt_ids: tuple[int, ...]
    turns: tuple[ChatTurn, ...]
    arrivals_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.arrivals_s) != len(self.turns):
            raise ValueError(f"session {self.session_id}: {len(self.arrivals_s)} arrivals, {len(self.turns)} turns")

    def recorded_requests(self) -> Iterator[SimRequest]:
        """The session's model calls with the recorded replies (see the module docstring)."""
        prompt = self.first_prompt_ids
        for k, turn in enumerate(self.turns):
            yield SimRequest(
                request_id=f"{self.session_id}/{k}",
                prompt_ids=prompt,
                output_ids=turn.reply_ids + turn.after_ids[:1],
                arrival_s=self.arrivals_s[k],
                session_id=self.session_id,
                turn=k,
            )
            prompt = prompt + turn.reply_ids + turn.after_ids


@dataclass(frozen=True)
class Workload:
    """A named, deterministic stream of requests, rendered lazily (a Mooncake replay holds ~10^8 tokens).

    `render()` yields the requests in arrival order; every call yields the same requests. `sessions` is set
    for chat workloads, whose turns the engine benchmark replays with generated replies.
    """

    name: str
    num_requests: int
    render: Callable[[], Iterator[SimRequest]] = field(repr=False)
    sessions: tuple[ChatSession, ...] | None = field(default=None, repr=False)

    def __iter__(self) -> Iterator[SimRequest]:
        return self.render()

    def __len__(self) -> int:
        return self.num_requests


def interleave_sessions(sessions: tuple[ChatSession, ...]) -> Iterator[SimRequest]:
    """Every session's recorded requests, merged in arrival order (ties: session order, then turn)."""
    order = sorted(
        (arrival, i, k) for i, s in enumerate(sessions) for k, arrival in enumerate(s.arrivals_s)
    )
    iters = [s.recorded_requests() for s in sessions]
    for _, i, _ in order:
        yield next(iters[i])


def chat_workload(name: str, sessions: tuple[ChatSession, ...]) -> Workload:
    return Workload(
        name, sum(len(s.turns) for s in sessions), lambda: interleave_sessions(sessions), sessions=sessions
    )


def session_arrivals(num_turns: int, start_s: float, rng: np.random.Generator, think_s: float) -> tuple[float, ...]:
    """Arrival times of a session's calls: the first at `start_s`, then exponential gaps of mean `think_s`."""
    gaps = rng.exponential(think_s, size=max(num_turns - 1, 0))
    return tuple(float(t) for t in np.concatenate([[start_s], start_s + np.cumsum(gaps)]))


def random_tokens(rng: np.random.Generator, length: int, vocab: int) -> tuple[int, ...]:
    """`length` uniform token ids in [0, vocab)."""
    return tuple(rng.integers(0, vocab, size=length).tolist())


def truncate_sessions(sessions: tuple[ChatSession, ...], num_requests: int) -> tuple[ChatSession, ...]:
    """Keep the first `num_requests` calls in arrival order (a prefix of each session's turns; sessions left
    with no call are dropped)."""
    order = sorted((arrival, i, k) for i, s in enumerate(sessions) for k, arrival in enumerate(s.arrivals_s))
    kept = [0] * len(sessions)
    for _, i, _ in order[:num_requests]:
        kept[i] += 1
    return tuple(
        ChatSession(s.session_id, s.first_prompt_ids, s.turns[:m], s.arrivals_s[:m])
        for s, m in zip(sessions, kept)
        if m
    )
