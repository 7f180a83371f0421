"""Which replica a request goes to (pure Python; the simulator's bench/routing.py models the same rules).

    checkpoint   the longest usable hit predicted from the replica's cache events: KV *and* a state at that
                 step (`ReplicaIndex.predict().cached_len`)
    kv-prefix    the most full KV blocks of the prompt (`predict().kv_len`), what a KV-only router knows
    round-robin  in turn

The prefix policies follow SGLang's cache-aware router: the best replica is taken when its score covers at
least `min_hit_fraction` of the prompt (SGLang's cache threshold) and its load (requests in flight through the
router) exceeds the least-loaded replica's by no more than `abs_margin` or by no more than `rel_margin` times;
otherwise the least-loaded one is (a miss everywhere too). The threshold keeps a few tokens of a shared chat
template from pulling every new conversation to one replica (bench/routing.py measures both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridcache.cache.request import Probe

ROUTER_POLICIES = ("checkpoint", "kv-prefix", "round-robin")


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
        if self.abs_margin < 0 or self.rel_margin < 1.0:
            raise ValueError(f"balance margins must be abs >= 0 and rel >= 1, got {self.abs_margin}, "
                             f"{self.rel_margin}")
        if not 0.0 <= self.min_hit_fraction <= 1.0:
            raise ValueError(f"min_hit_fraction must be in [0, 1], got {self.min_hit_fraction}")


class Chooser:
    """`choose(probes, loads, prompt_len)`: the index of the replica to use among the candidates given (module
    docstring); `prompt_len`: the tokens the probes were predicted for."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self._turn = 0

    def choose(self, probes: Sequence[Probe], loads: Sequence[int], prompt_len: int) -> int:
        if not probes or len(probes) != len(loads):
            raise ValueError(f"need one probe per load and at least one, got {len(probes)} and {len(loads)}")
        n = len(probes)
        least = min(range(n), key=lambda r: (loads[r], r))
        if self.config.policy == "round-robin":
            self._turn += 1
            return (self._turn - 1) % n
        scores = [p.cached_len if self.config.policy == "checkpoint" else p.kv_len for p in probes]
        best = max(range(n), key=lambda r: (scores[r], -loads[r], -r))
        if scores[best] == 0 or scores[best] < self.config.min_hit_fraction * prompt_len:
            return least
        if loads[best] - loads[least] > self.config.abs_margin and loads[best] > self.config.rel_margin * loads[least]:
            return least
        return best
