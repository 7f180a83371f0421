"""What the cache keeps for one running sequence."""

from __future__ import annotations

from collections.abc import Hashable

from hybridcache.cache.checkpoint import Checkpoint
from hybridcache.cache.plan import CopyKind
from hybridcache.cache.request import CacheRequest
from hybridcache.cache.trie import Node

# A fed token whose value is not known yet (async scheduling: the previous step's sample, still on the device).
# `PrefixCache.commit_step` accepts it as the last token a decoding sequence feeds; `fill_pending` sets it.
PENDING_TOKEN = -1


class RunningSeq:
    """A running sequence: its tokens, blocks, trie nodes, runtime slot and this step's pending work.

    token_ids         every token fed so far (the cached prefix included): num_computed = len(token_ids).
                      The last one may be PENDING_TOKEN until `PrefixCache.fill_pending` (async scheduling).
    block_ids         its blocks in order; block i holds positions [i*B, (i+1)*B). The first len(nodes)
                      are full and in the trie (shared, read-only); the others are private to it. Every
                      full block is in the trie, except one whose last token is still PENDING_TOKEN.
    nodes             nodes[i] is the trie node of block i (its depth is i + 1).
    slot              its runtime state slot.
    restore           the checkpoint restored at admission, pinned until the next commit, and its copies.
    saves             checkpoints reserved for the step being planned (RESERVED, pinned).
    decode_ckpt       its live decode-interval checkpoint, if any.
    shadows           the turn-end checkpoint it was restored from, until its first deeper checkpoint of the
                      same chain is published and shadows it (`Checkpoint.shadowed`).
    """

    __slots__ = (
        "request", "token_ids", "block_ids", "nodes", "slot", "restore", "restore_copies", "saves",
        "decode_ckpt", "shadows", "num_drafts",
    )

    def __init__(self, *, request: CacheRequest, slot: int) -> None:
        self.request = request
        self.token_ids: list[int] = []
        self.block_ids: list[int] = []
        self.nodes: list[Node] = []
        self.slot = slot
        self.restore: Checkpoint | None = None
        self.restore_copies: list[tuple[CopyKind, int, int]] = []
        self.saves: list[Checkpoint] = []
        self.decode_ckpt: Checkpoint | None = None
        self.shadows: Checkpoint | None = None
        self.num_drafts = 0

    @property
    def num_computed(self) -> int:
        return len(self.token_ids)

    def num_trie_blocks(self, block_size: int) -> int:
        """How many of its blocks belong in the trie: every full one, except one whose last token is still
        `PENDING_TOKEN` (it joins at `PrefixCache.fill_pending`)."""
        num_full = len(self.token_ids) // block_size
        if num_full and self.token_ids[num_full * block_size - 1] == PENDING_TOKEN:
            return num_full - 1
        return num_full

    @property
    def slot_owner(self) -> tuple[str, object]:
        return self.slot_owner_of(self.request.request_id)

    @staticmethod
    def slot_owner_of(request_id: Hashable) -> tuple[str, object]:
        """The `StatePool` owner key of a running sequence's slot (known before the sequence exists)."""
        return ("seq", request_id)

    @property
    def has_pending_work(self) -> bool:
        return self.restore is not None or bool(self.saves) or self.num_drafts > 0
