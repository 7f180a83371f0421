"""`LearnedAdmission`: admit a kind of save (save reason x adapter) only while it pays for its bytes.

Every published checkpoint ends in one outcome for its kind: a **use** (hit at least once before it is
released; it counts the prefill tokens that first hit saved) or a **waste** (released unhit: evicted,
replaced, cleared). A declined save leaves a **ghost** (its prefix identity: root, anchor depth and hash,
step, tail tokens) in a bounded table; a later admission that would have hit a ghost deeper than what it
got counts a ghost use for the ghost's kind (worth the ghost's step), and a ghost pushed out of the table
unused counts a ghost waste. So a declined kind keeps being measured, and comes back when its saves would
pay again.

Every save of any kind costs the same bytes (a state: k blocks of the pool, plus at most one frozen block),
so what a save is worth is the prefill tokens it saves. A kind's **value** is the tokens its checkpoints
saved per outcome, over real and ghost outcomes, smoothed by two outcomes at the mean of all published
checkpoints (`prior`). A kind is admitted while its value is at least `share` (1/2) of that mean (a save
worth less than half the average one takes bytes from better ones), or at least `cheap_tokens`: the tokens
of KV its bytes would hold otherwise (k x block size with paged states), so that a save that returns more
than its bytes' worth of KV is kept even when other kinds return more. Counts halve whenever a kind's
outcomes reach `window`, so the values follow the workload (online). Counting hits instead of tokens
declines the wrong kind when the rare hits are the deep ones (a chat's turn ends under pressure: see the
worked example); measured in docs/cache.md.

Worked example (share 1/2, cheap_tokens 3,200: a state of 50 blocks of 64 tokens). Finish checkpoints:
4 used, saving 2,000 tokens each, 96 wasted; branch points: 90 used, saving 16 tokens each, 10 wasted. Mean
of all: (8,000 + 1,440) / 200 = 47.2 tokens per save. Finish: (8,000 + 2 x 47.2) / 102 = 79.4 >= 23.6,
admitted; branch points: (1,440 + 94.4) / 102 = 15.0 < 23.6 (and < 3,200), declined, each decline a ghost.
If the ghosts of declined branch points keep being hit, their value climbs back and they are admitted again.
Counting hits alone, finish (5 / 102 = 0.05) would be declined and branch points (91 / 102) admitted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from hybridcache.cache.request import SaveReason
from hybridcache.cache.trie import RootKey

Kind = tuple[SaveReason, str | None]
GhostKey = tuple[RootKey, int, Hashable]  # (root: adapter and cache salt, anchor depth, anchor hash; 0 at depth 0)


@dataclass
class Outcomes:
    uses: float = 0.0
    wastes: float = 0.0
    tokens: float = 0.0  # prefill tokens the hits saved

    @property
    def total(self) -> float:
        return self.uses + self.wastes

    def mean(self) -> float:
        """Tokens saved per outcome (0 before any)."""
        return self.tokens / self.total if self.total else 0.0

    def value(self, prior: float) -> float:
        """Tokens saved per outcome, smoothed by two outcomes worth `prior` each."""
        return (self.tokens + 2.0 * prior) / (self.total + 2.0)

    def halve(self) -> None:
        self.uses /= 2
        self.wastes /= 2
        self.tokens /= 2


@dataclass
class LearnedAdmission:
    """See the module docstring. `capacity`: ghosts kept (about the number of checkpoints the pool holds);
    `cheap_tokens`: a kind worth at least this many tokens per save is always admitted (inf: never by that
    rule alone)."""

    capacity: int = 64
    share: float = 0.5
    window: float = 256.0
    cheap_tokens: float = float("inf")
    kinds: dict[Kind, Outcomes] = field(default_factory=dict)
    overall: Outcomes = field(default_factory=Outcomes)
    ghosts: OrderedDict[GhostKey, list[tuple[int, tuple[int, ...], Kind]]] = field(default_factory=OrderedDict)
    num_ghosts: int = 0

    def admit(self, reason: SaveReason, adapter: str | None) -> bool:
        kind = self.kinds.get((reason, adapter))
        if kind is None:
            return True
        prior = self.overall.mean()
        value = kind.value(prior)
        return value >= self.share * prior or value >= self.cheap_tokens

    def _record(self, kind: Kind, used: bool, *, real: bool, tokens: int = 0) -> None:
        out = self.kinds.setdefault(kind, Outcomes())
        out.tokens += tokens
        if used:
            out.uses += 1
        else:
            out.wastes += 1
        if real:
            self.overall.tokens += tokens
            if used:
                self.overall.uses += 1
            else:
                self.overall.wastes += 1
            if self.overall.total >= 4 * self.window:
                self.overall.halve()
        if out.total >= self.window:
            out.halve()

    def used(self, reason: SaveReason, adapter: str | None, tokens: int) -> None:
        """A published checkpoint of this kind was hit for the first time, saving `tokens`."""
        self._record((reason, adapter), True, real=True, tokens=tokens)

    def wasted(self, reason: SaveReason, adapter: str | None) -> None:
        """A published checkpoint of this kind was released without a hit."""
        self._record((reason, adapter), False, real=True)

    def declined(self, reason: SaveReason, adapter: str | None, key: GhostKey, step: int,
                 tail: tuple[int, ...]) -> None:
        """Remember a declined save as a ghost (the oldest ghost leaves, a ghost waste, when full)."""
        self.ghosts.setdefault(key, []).append((step, tail, (reason, adapter)))
        self.ghosts.move_to_end(key)
        self.num_ghosts += 1
        while self.num_ghosts > self.capacity:
            old_key, entries = next(iter(self.ghosts.items()))
            _, _, kind = entries.pop(0)
            self.num_ghosts -= 1
            if not entries:
                del self.ghosts[old_key]
            self._record(kind, False, real=False)

    def ghost_hit(self, keys: Sequence[GhostKey], prompt: Sequence[int], block_size: int, got: int,
                  max_step: int) -> None:
        """An admission over the path `keys` (deepest first) got `got` tokens: each ghost on the path that
        would have given more (its tail matches the prompt) counts a ghost use and is dropped."""
        for key in keys:
            entries = self.ghosts.get(key)
            if not entries:
                continue
            base = key[1] * block_size
            keep = []
            for step, tail, kind in entries:
                if got < step <= max_step and tuple(prompt[base:step]) == tail:
                    self._record(kind, True, real=False, tokens=step)
                    self.num_ghosts -= 1
                else:
                    keep.append((step, tail, kind))
            if keep:
                self.ghosts[key] = keep
            else:
                del self.ghosts[key]
