"""The tokens a step takes from the step before it without the host seeing them (async scheduling).

With async scheduling, step t+1 is planned and launched before step t's sampled tokens reach the host: each
decoding sequence's input row holds `PENDING_TOKEN` and is written on the device, right before the forward,
from t's sampled tokens [rows of t]. A `TokenFeed` says which rows take which sampled token; the executor writes
them (`ModelRunner.execute(batch, feed)`). Under tensor parallelism only rank 0 holds the sampled tokens: it
broadcasts them to the other ranks on the device (`hybridcache.distributed`), each rank writes its own copy of
the batch's `input_ids`, and `rows` / `sources` travel with the step's message as plain integers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.sampling import to_device


@dataclass(frozen=True)
class TokenFeed:
    """Input row `rows[i]` of the step takes `tokens[sources[i]]`. `tokens`: the step before's sampled tokens
    [its sampled rows], int64, on the device the forward runs on (never read on the host)."""

    rows: tuple[int, ...]
    sources: tuple[int, ...]
    tokens: torch.Tensor

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.sources):
            raise ValueError(f"a token feed needs one source per row: {len(self.rows)} rows, "
                             f"{len(self.sources)} sources")

    def write(self, input_ids: torch.Tensor) -> None:
        """Write the fed tokens into `input_ids` in place (one `index_copy_` on its device, no host wait)."""
        if not self.rows:
            return
        index = to_device(list(self.rows) + list(self.sources), input_ids.device)
        tokens = self.tokens.to(input_ids.device).index_select(0, index[len(self.rows):])
        input_ids.index_copy_(0, index[: len(self.rows)], tokens.to(input_ids.dtype))
