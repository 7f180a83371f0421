"""The checkpoint record and its step geometry (matching.py searches for the deepest usable one).

Geometry (B = block_size): a checkpoint at step s has q = s // B full blocks and r = s % B tail tokens.

    s = 3B + 17:  [ block 0 ][ block 1 ][ block 2 ][ 17 tail tokens | ...... ]
                                         ^ anchor (depth 3, ends at 3B)
                  state slot (or k pages) = recurrent state after tokens [0, s)
                  frozen block = private copy of the KV of tokens [3B, s)   (only when r > 0)

    s = B - 1:    anchor = the root (of its adapter and cache salt), tail = tokens [0, B - 1)
    s = 2B:       anchor = the node of block 1, no tail, no frozen block

Life: RESERVED (slot or pages, and frozen block taken, not visible to matches) -> PUBLISHED (hangs on its
anchor, matchable) -> RELEASED (all returned). `num_pins > 0` forbids release and eviction.
"""

from __future__ import annotations

from collections.abc import Hashable
from enum import Enum
from typing import Any

from hybridcache.cache.request import SaveReason
from hybridcache.cache.trie import Node, RootKey


class CheckpointState(str, Enum):
    RESERVED = "reserved"
    PUBLISHED = "published"
    RELEASED = "released"


class Checkpoint:
    """A saved recurrent state at an exact step (see the module docstring for the geometry).

    Constructed by keyword once its slot or pages (and frozen block, when partial) are held, so no field is
    ever a placeholder::

        Checkpoint(ckpt_id=7, adapter=None, step=3 * B + 17, reason=SaveReason.CHUNK_END, slot=12,
                   frozen_block=40, routed_experts=None, owner="req-1", last_access=now)

    adapter / salt         the root it was saved under (`root_key`): only requests with the same adapter and
                           cache salt may restore it.
    slot / pages           where the state is: a state slot (two pools; `pages` empty) or k KV blocks
                           (paged, `CacheConfig.state_pages`; `slot` None).

    tail_ids / tail_spans  the r tokens past the anchor and the spans overlapping them (absolute offsets);
                           filled at publish time, when the producing sequence has fed them.
    tail_hash              the hash of the tail chained from the anchor (the index key), set at publish time.
    routed_experts         the tail's routed-expert history (opaque), None when not known.
    owner                  the request that produced it (for the one-live-decode-checkpoint rule).
    on_host                demoted to the host tier (host_tier.py): `pages` and `frozen_block` name host blocks,
                           and `anchor` is a device node or a `HostNode`.
    unwritten              a finish or preempt checkpoint whose state copy (STATE_FINISH) the next plan carries:
                           its pages hold nothing yet (demoted meanwhile: that plan copies the runtime slot into
                           its host pages, HOST_FINISH).
    shadowed               a turn end (prefill end, finish, preempt) that a sequence was restored from and
                           then went past, publishing a deeper checkpoint of the same chain: the next turn it
                           was kept for has come, and it now serves only prompts that leave the chain between
                           its step and the deeper one (an edited message, a regenerated reply, a resend), so
                           it is the first to go under pressure (`Evictor`). A hit clears it.
    """

    __slots__ = (
        "ckpt_id", "adapter", "salt", "step", "reason", "slot", "pages", "frozen_block", "tail_ids", "tail_spans",
        "tail_hash", "routed_experts", "anchor", "state", "num_pins", "last_access", "owner", "release_when_unpinned",
        "was_hit", "shadowed", "on_host", "unwritten",
    )

    def __init__(
        self, *, ckpt_id: int, adapter: str | None, step: int, reason: SaveReason, slot: int | None,
        frozen_block: int | None, routed_experts: Any, owner: Hashable, last_access: int,
        pages: tuple[int, ...] = (), salt: str | None = None,
    ) -> None:
        self.ckpt_id = ckpt_id
        self.adapter = adapter
        self.salt = salt
        self.step = step
        self.reason = reason
        self.slot = slot
        self.pages = pages
        self.frozen_block = frozen_block
        self.tail_ids: tuple[int, ...] = ()
        self.tail_spans: tuple = ()
        self.tail_hash = 0
        self.routed_experts = routed_experts
        self.anchor: Node | None = None
        self.state = CheckpointState.RESERVED
        self.num_pins = 0
        self.last_access = last_access
        self.owner = owner
        self.release_when_unpinned = False
        self.was_hit = False  # restored at least once (admission learning)
        self.shadowed = False  # a continuation restored from it went deeper (evicted first)
        self.on_host = False  # demoted to the host tier: `pages` / `frozen_block` are host block ids
        self.unwritten = False  # paged finish: its STATE_FINISH copy is not in a plan yet

    @staticmethod
    def slot_owner_of(ckpt_id: int) -> tuple[str, int]:
        """The `StatePool` owner key of checkpoint `ckpt_id`'s slot (known before the checkpoint exists)."""
        return ("ckpt", ckpt_id)

    @property
    def is_usable(self) -> bool:
        """Published, still hanging on an attached anchor, not released."""
        return self.state is CheckpointState.PUBLISHED and self.anchor is not None and self.anchor.attached

    @property
    def root_key(self) -> RootKey:
        return RootKey(self.adapter, self.salt)

    @property
    def slot_owner(self) -> tuple[str, int]:
        return self.slot_owner_of(self.ckpt_id)

    def __repr__(self) -> str:
        return (
            f"Checkpoint(id={self.ckpt_id}, step={self.step}, reason={self.reason.value}, "
            f"state={self.state.value}, pins={self.num_pins})"
        )
