"""`mooncake`: the Mooncake conversation trace (FAST '25), one JSON object per line:
`{"timestamp" (ms), "input_length", "output_length", "hash_ids"}`, one hash id per 512-token block.

Replay: hash id h becomes a fixed pseudo-random block of 512 tokens drawn from `default_rng([seed, h])`
(so it depends only on the seed and the id, not on how the trace is cut), the prompt is the concatenation
of its ids' blocks cut to `input_length`, and the output is `output_length` pseudo-random tokens private to
the request. Arrivals are the timestamps times `time_scale`.

Token ids are drawn from `[0, min(vocab, 256))`: CPython shares the int objects of small numbers, so a
cache trie holding 10^8 tokens costs 8 bytes a token instead of 36. Distinct blocks still differ (a
collision of two 512-token blocks has probability 256^-512).

    hash_ids [0, 7, 9], input_length 1100:
    tokens   [ block(0): 512 ][ block(7): 512 ][ block(9)[:76] ]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridcache.bench.workloads.base import SimRequest, Workload
from hybridcache.bench.workloads.records import integer, items_of, json_records

MOONCAKE_BLOCK_LEN = 512


@dataclass(frozen=True)
class MooncakeRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_mooncake(path: str | Path, num_requests: int | None = None) -> list[MooncakeRecord]:
    """The trace's first `num_requests` records; a malformed line is a ValueError `"{path}:{line}: ..."` naming
    what is wrong (a missing field, a hash id or length that is not an integer, a length that does not fit)."""
    records = []
    for where, r in json_records(path):
        if num_requests is not None and len(records) >= num_requests:
            break
        hash_ids = tuple(_hash_id(h, where) for h in items_of(r, "hash_ids", where))
        input_length = integer(r, "input_length", where, minimum=1)
        if input_length > len(hash_ids) * MOONCAKE_BLOCK_LEN:
            raise ValueError(f"{where}: input_length {input_length} does not fit {len(hash_ids)} blocks of "
                             f"{MOONCAKE_BLOCK_LEN} tokens")
        timestamp = r.get("timestamp")
        if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)):
            raise ValueError(f"{where}: 'timestamp' must be a number, got {timestamp!r}")
        records.append(MooncakeRecord(float(timestamp), input_length,
                                      max(1, integer(r, "output_length", where, minimum=0)), hash_ids))
    return records


def _hash_id(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: hash ids must be integers, got {value!r}")
    if value < 0:  # (numpy's seed sequence, which draws the id's block, takes no negative entropy)
        raise ValueError(f"{where}: hash ids must be non-negative, got {value}")
    return value


class BlockTokens:
    """The pseudo-random token block of each hash id, generated on first use and kept (uint8, 512 bytes)."""

    def __init__(self, seed: int, vocab: int) -> None:
        self.seed = seed
        self.vocab = min(vocab, 256)
        self._blocks: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        block = self._blocks.get(hash_id)
        if block is None:
            rng = np.random.default_rng([self.seed, hash_id])
            block = rng.integers(0, self.vocab, size=MOONCAKE_BLOCK_LEN, dtype=np.uint8)
            self._blocks[hash_id] = block
        return block

    def prompt(self, hash_ids: tuple[int, ...], length: int) -> tuple[int, ...]:
        return tuple(np.concatenate([self.block(h) for h in hash_ids])[:length].tolist())


def mooncake_workload(
    path: str | Path,
    *,
    seed: int = 0,
    num_requests: int | None = None,
    time_scale: float = 1.0,
    vocab: int = 256,
) -> Workload:
    """The trace's first `num_requests` requests, rendered lazily (see the module docstring)."""
    records = read_mooncake(path, num_requests)

    def render() -> Iterator[SimRequest]:
        blocks = BlockTokens(seed, vocab)
        for i, r in enumerate(records):
            out_rng = np.random.default_rng([seed, 1 << 40, i])
            yield SimRequest(
                request_id=f"mooncake/{i}",
                prompt_ids=blocks.prompt(r.hash_ids, r.input_length),
                output_ids=tuple(out_rng.integers(0, blocks.vocab, size=r.output_length).tolist()),
                arrival_s=r.timestamp_ms / 1000.0 * time_scale,
                session_id=f"mooncake/{i}",
            )

    return Workload("mooncake", len(records), render)
