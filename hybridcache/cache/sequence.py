"""What the cache keeps for one running sequence."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from hybridcache.cache.checkpoint import Checkpoint
from hybridcache.cache.plan import CopyKind
from hybridcache.cache.request import CacheRequest
from hybridcache.cache.trie import Node

# A fed token whose value is not known yet (async scheduling: the previous step's sample, still on the device).
# `PrefixCache.commit_step` accepts it as the last token a decoding sequence feeds; `PrefixCache.accept` gives
# its value.
PENDING_TOKEN = -1


class RunningSeq:
    """A running sequence: its tokens, blocks, trie nodes, runtime slot and this step's pending work.

    token_ids         the sequence's token list, starting with its prompt: the list the caller gave `admit` (the
                      scheduler's `Seq.token_ids`, the one owner of the tokens: the cache reads it and never
                      copies it), or one the cache made from the prompt. Its first `num_computed` entries are the
                      tokens fed so far (the cached prefix included); it may hold more (the rest of the prompt, a
                      sample not fed yet), which the cache does not read. The cache writes a token only where the
                      list holds none yet (past its end, or a PENDING_TOKEN): an owner writes its tokens first,
                      and the cache then only checks them.
    num_computed      tokens fed so far; token `num_computed - 1` is unknown while `pending`.
    pending           its last fed token was PENDING_TOKEN and `PrefixCache.accept` has not given its value yet.
    num_drafts        speculative decoding: drafts fed after token `num_computed - 1`, until `accept` judges them.
    block_ids         its blocks in order; block i holds positions [i*B, (i+1)*B). The first len(nodes)
                      are full and in the trie (shared, read-only); the others are private to it. Every
                      full block is in the trie, except one whose last token is still pending.
    nodes             nodes[i] is the trie node of block i (its depth is i + 1).
    slot              its runtime state slot.
    restore           the checkpoint restored at admission, pinned until the next commit, and its copies.
    saves             checkpoints reserved for the step being planned (RESERVED, pinned).
    decode_ckpt       its live decode-interval checkpoint, if any.
    shadows           the turn-end checkpoint it was restored from, until its first deeper checkpoint of the
                      same chain is published and shadows it (`Checkpoint.shadowed`).
    """

    __slots__ = (
        "request", "token_ids", "num_computed", "pending", "block_ids", "nodes", "slot", "restore", "restore_copies",
        "saves", "decode_ckpt", "shadows", "num_drafts",
    )

    def __init__(self, *, request: CacheRequest, token_ids: list[int], slot: int) -> None:
        self.request = request
        self.token_ids = token_ids
        self.num_computed = 0
        self.pending = False
        self.block_ids: list[int] = []
        self.nodes: list[Node] = []
        self.slot = slot
        self.restore: Checkpoint | None = None
        self.restore_copies: list[tuple[CopyKind, int, int]] = []
        self.saves: list[Checkpoint] = []
        self.decode_ckpt: Checkpoint | None = None
        self.shadows: Checkpoint | None = None
        self.num_drafts = 0

    def num_trie_blocks(self, block_size: int) -> int:
        """How many of its blocks belong in the trie: every full one, except one whose last token is still
        pending (it joins at `PrefixCache.accept`)."""
        num_full = self.num_computed // block_size
        if num_full and self.pending and self.num_computed % block_size == 0:
            return num_full - 1
        return num_full

    def check_tokens(self, start: int, tokens: Sequence[int]) -> bool:
        """Whether `tokens`, made known after they were fed (`PrefixCache.accept`), may be the sequence's tokens
        at [start, start + len): the list holds each of them, or a PENDING_TOKEN, or ends before it (no gap)."""
        held = self.token_ids[start:start + len(tokens)]
        return start <= len(self.token_ids) and all(h in (t, PENDING_TOKEN) for h, t in zip(held, tokens))

    def put_tokens(self, start: int, tokens: Sequence[int]) -> None:
        """Make `tokens` the list's entries at [start, start + len) (`check_tokens` passed): a held token is
        rewritten with its own value, a PENDING_TOKEN gets its value, the rest are appended."""
        self.token_ids[start:start + len(tokens)] = tokens

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
