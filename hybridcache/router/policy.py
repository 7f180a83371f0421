"""Which replica a request goes to (pure Python; the simulator's bench/routing.py models the same rules).

    checkpoint   the longest usable hit predicted from the replica's cache events: KV *and* a state at that
                 step (`ReplicaIndex.predict().cached_len`); when no replica has one, the conversation's own
                 replica: the one holding the most of the prompt's KV, when that KV is at least `CHAIN_SHARE` of
                 the stored chain it matches (`ReplicaIndex.chain_len`)
    kv-prefix    the most full KV blocks of the prompt (`predict().kv_len`), what a KV-only router knows
    round-robin  in turn

The prefix policies follow SGLang's cache-aware router: the best replica is taken when its score covers at
least `min_hit_fraction` of the prompt (SGLang's cache threshold) and its load (requests in flight through the
router) exceeds the least-loaded replica's by no more than `abs_margin` or by no more than `rel_margin` times;
otherwise the least-loaded one is (a miss everywhere too). The threshold keeps a few tokens of a shared chat
template from pulling every new conversation to one replica (bench/routing.py measures both). Among replicas of
equal load, the least-loaded one is the one whose index holds the fewest blocks (SGLang's smallest tree), then
the first listed: new conversations on an idle fleet spread over the replicas instead of all going to the first.

Why the checkpoint policy follows KV without a state, and only along the conversation's own chain: a request
whose prompt matches a replica's KV past any state there saves a state where it parts from that KV (the engine's
branch point), so the conversation's next turn hits there. When the KV is most of the chain it matches, the
request is a later turn of the conversation stored there (whose state was never saved at this step: Mooncake's
turns part one 512-token block before the earlier turn's end); following it keeps the conversation together.
When the KV is a short prefix of a longer chain (a sibling sharing a system prompt with another conversation),
the request goes to the least-loaded replica: sending such requests to one replica piles new conversations there,
and the balance margin then pushes the turns of those with long chains away from their states (docs/bench.md,
"Many replicas", measures both sides).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridcache.cache.request import Probe

ROUTER_POLICIES = ("checkpoint", "kv-prefix", "round-robin")
CHAIN_SHARE = 0.5  # the checkpoint policy follows KV without a state when it is at least this share of its chain


@dataclass(frozen=True)
class RoutingConfig:
    """policy: one of `ROUTER_POLICIES`; abs_margin / rel_margin / min_hit_fraction: the rule above."""

    policy: str = "checkpoint"
    abs_margin: int = 2
    rel_margin: float = 1.5
    min_hit_fraction: float = 0.3

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose from {', '.join(ROUTER_POLICIES)}")
        if not (self.abs_margin >= 0 and 1.0 <= self.rel_margin < float("inf")):  # a nan margin is refused too
            raise ValueError(f"balance margins must be abs >= 0 and rel >= 1, got {self.abs_margin}, "
                             f"{self.rel_margin}")
        if not 0.0 <= self.min_hit_fraction <= 1.0:
            raise ValueError(f"min_hit_fraction must be in [0, 1], got {self.min_hit_fraction}")


class Chooser:
    """`choose(probes, loads, prompt_len, chain_of, sizes)`: the index of the replica to use among the candidates
    given (module docstring); `prompt_len`: the tokens the probes were predicted for; `chain_of(i, limit)`: the
    tokens of the stored chain candidate i's KV match sits on (`ReplicaIndex.chain_len`), asked only when no usable
    hit passes the threshold (None: never follow KV without a state); `sizes`: each candidate's indexed blocks,
    which break ties of load (None: ties go to the first listed).

    Example: three idle replicas indexing 40, 12 and 12 blocks; a miss goes to replica 1 (load 0, 12 blocks)."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self._turn = 0

    def choose(self, probes: Sequence[Probe], loads: Sequence[int], prompt_len: int,
               chain_of: Callable[[int, int], int] | None = None, sizes: Sequence[int] | None = None) -> int:
        if not probes or len(probes) != len(loads) or sizes is not None and len(sizes) != len(loads):
            raise ValueError(f"need one probe per load (and one size, if any) and at least one, got {len(probes)}, "
                             f"{len(loads)} and {None if sizes is None else len(sizes)}")
        n = len(probes)
        least = min(range(n), key=lambda r: (loads[r], 0 if sizes is None else sizes[r], r))
        if self.config.policy == "round-robin":
            self._turn += 1
            return (self._turn - 1) % n
        checkpoint = self.config.policy == "checkpoint"
        scores = [p.cached_len if checkpoint else p.kv_len for p in probes]
        threshold = self.config.min_hit_fraction * prompt_len
        best = max(range(n), key=lambda r: (scores[r], -loads[r], -r))
        if scores[best] == 0 or scores[best] < threshold:
            best = self._own_chain(probes, loads, threshold, chain_of) if checkpoint else None
            if best is None:
                return least
        if loads[best] - loads[least] > self.config.abs_margin and loads[best] > self.config.rel_margin * loads[least]:
            return least
        return best

    @staticmethod
    def _own_chain(probes: Sequence[Probe], loads: Sequence[int], threshold: float,
                   chain_of: Callable[[int, int], int] | None) -> int | None:
        """The replica holding the most of the prompt's KV (at least `threshold`) when that KV is at least
        `CHAIN_SHARE` of the chain it matches; None otherwise."""
        if chain_of is None:
            return None
        best = max(range(len(probes)), key=lambda r: (probes[r].kv_len, -loads[r], -r))
        kv = probes[best].kv_len
        if kv == 0 or kv < threshold:
            return None
        limit = int(kv / CHAIN_SHARE) + 1
        return best if kv >= CHAIN_SHARE * chain_of(best, limit) else None
