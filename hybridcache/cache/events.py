"""Cache events: what a prefix cache stores and drops, for a router that predicts hits on many replicas.

Four kinds, each identified by the hashes the trie already uses (trie.py: `chain_hash`, `root_hash`)::

    block_stored        block_hash, parent_hash, depth, adapter   a full block joined the trie
    block_removed       block_hash                                 a leaf left the trie (evicted, cleared)
    checkpoint_stored   anchor_hash, step, tail_hash, adapter      a checkpoint was published (matchable)
    checkpoint_removed  anchor_hash, step, tail_hash               a published checkpoint was released

`anchor_hash` is the hash of the node the checkpoint hangs on (`root_hash(adapter, salt)` when step < B) and
`tail_hash = chain_hash(anchor_hash, prompt[q*B:step], spans)`, so whoever holds a prompt's tokens can
recompute every hash and ask "is there KV up to block q *and* a state at step s here?" without the tokens
being sent (vLLM's BlockStored / BlockRemoved are the model; checkpoints are what hybrid models add).
A cache salt (`CacheRequest.cache_salt`) is never told: a salted request's blocks chain from its salted root, so
their hashes can be recomputed (and a hit predicted) only by a reader that holds the prompt *and* the salt (the
router reads both from the request body).

With a host tier (host_tier.py) the events describe the device tier: a demotion to the host is a removal, a
promotion back a store, and what the host holds is not told (a router then under-predicts host hits).

`CacheEventLog` keeps the newest `capacity` events, each numbered from 0 on. A reader asks for the events
after the last number it saw (`since`); when older ones were dropped it learns so (`lost`) and must start
again from a snapshot (`PrefixCache.snapshot_events`), taken on the thread that drives the cache. Each log has
a random `epoch`: numbers of one log mean nothing in another (a restarted server), so a reader that sees the
epoch change starts again from a snapshot too.

Threads: `emit` is called by the thread that drives the cache; `since` may be called from any thread.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from dataclasses import dataclass
from enum import Enum
from itertools import islice


class EventKind(str, Enum):
    BLOCK_STORED = "block_stored"
    BLOCK_REMOVED = "block_removed"
    CHECKPOINT_STORED = "checkpoint_stored"
    CHECKPOINT_REMOVED = "checkpoint_removed"


@dataclass(frozen=True)
class CacheEvent:
    """One change of a cache (see the module docstring for which fields each kind fills; others are 0/None)."""

    kind: EventKind
    block_hash: int = 0
    parent_hash: int = 0
    depth: int = 0
    anchor_hash: int = 0
    step: int = 0
    tail_hash: int = 0
    adapter: str | None = None

    def to_json(self) -> dict:
        """Every field by name, `kind` as its value (spelled out: `dataclasses.asdict` takes 20 times as long, and
        a snapshot has one event per block)."""
        return {"kind": self.kind.value, "block_hash": self.block_hash, "parent_hash": self.parent_hash,
                "depth": self.depth, "anchor_hash": self.anchor_hash, "step": self.step, "tail_hash": self.tail_hash,
                "adapter": self.adapter}

    @classmethod
    def from_json(cls, record: dict) -> CacheEvent:
        """The event `to_json` wrote; raises ValueError naming the problem for a malformed record."""
        try:
            return cls(**{**record, "kind": EventKind(record["kind"])})
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed cache event {record!r}: {error}") from None


@dataclass(frozen=True)
class EventBatch:
    """What `CacheEventLog.since` returns: the events numbered `first`, `first + 1`, ... (`next_seq` is the
    number the next event will get) and whether events the reader had not seen were dropped (`lost`)."""

    events: tuple[CacheEvent, ...]
    first: int
    next_seq: int
    lost: bool


class CacheEventLog:
    """A bounded, numbered buffer of `CacheEvent`s (see the module docstring)."""

    def __init__(self, capacity: int = 65536) -> None:
        if capacity < 1:
            raise ValueError(f"event log capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._events: deque[CacheEvent] = deque(maxlen=capacity)
        self._next_seq = 0
        self._lock = threading.Lock()
        self.epoch = uuid.uuid4().hex

    def emit(self, event: CacheEvent) -> None:
        with self._lock:
            self._events.append(event)
            self._next_seq += 1

    @property
    def next_seq(self) -> int:
        with self._lock:
            return self._next_seq

    def since(self, seq: int, limit: int | None = None) -> EventBatch:
        """The kept events numbered >= `seq` (at most `limit` of them); `lost` when some numbered in
        [seq, first kept) were dropped. `seq` past the newest number is an error (a reader from another log)."""
        with self._lock:
            first_kept = self._next_seq - len(self._events)
            if seq < 0 or seq > self._next_seq:
                raise ValueError(f"event number {seq} is outside [0, {self._next_seq}]")
            start = max(seq, first_kept)
            end = self._next_seq if limit is None else min(self._next_seq, start + max(limit, 0))
            events = tuple(islice(self._events, start - first_kept, end - first_kept))
            return EventBatch(events, start, end, lost=seq < first_kept)
