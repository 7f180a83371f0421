"""The kinds of copy op a step carries: which pool, which phase (before or after the forward, or after a verify
step's drafts are judged), what.

A pure-Python leaf (standard library only) shared by the prefix cache, which plans copies
(`hybridcache.cache.plan`), and the device side, which executes them (`hybridcache.forward_batch`, the runner's
copy table), so that neither imports the other.
"""

from __future__ import annotations

import enum


class Pool(enum.Enum):
    KV = "kv"
    STATE = "state"
    HOST = "host"  # device block <-> host block (the host tier)


class Phase(enum.Enum):
    BEFORE_FORWARD = "before_forward"
    AFTER_FORWARD = "after_forward"
    AFTER_VERIFY = "after_verify"  # once a verify step's drafts are judged (speculative decoding)


class CopyKind(enum.Enum):
    """What a copy op does; its value is (pool, phase, what). Declaration order is execution order."""

    HOST_FINISH = (Pool.HOST, Phase.BEFORE_FORWARD, "finish")  # the third item keeps values unique
    HOST_SAVE = (Pool.HOST, Phase.BEFORE_FORWARD, "save")
    HOST_LOAD = (Pool.HOST, Phase.BEFORE_FORWARD, "load")
    STATE_FINISH = (Pool.STATE, Phase.BEFORE_FORWARD, "finish")
    KV_RESTORE = (Pool.KV, Phase.BEFORE_FORWARD, "restore")
    STATE_RESTORE = (Pool.STATE, Phase.BEFORE_FORWARD, "restore")
    KV_SAVE = (Pool.KV, Phase.AFTER_FORWARD, "save")
    STATE_SAVE = (Pool.STATE, Phase.AFTER_FORWARD, "save")
    STATE_ROLLBACK = (Pool.STATE, Phase.AFTER_VERIFY, "rollback")  # speculative: draft state -> runtime slot

    @property
    def pool(self) -> Pool:
        return self.value[0]

    @property
    def phase(self) -> Phase:
        return self.value[1]

    @property
    def two_spaces(self) -> bool:
        """Sources and destinations are ids of two spaces (draft states and slots; device and host blocks) whatever
        the paging."""
        return self is CopyKind.STATE_ROLLBACK or self.pool is Pool.HOST

    @property
    def pageable(self) -> bool:
        """A paged cache's ops of this kind are paged (runtime chunks and pages)."""
        return self.pool is Pool.STATE and self is not CopyKind.STATE_ROLLBACK
