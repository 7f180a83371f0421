"""The prefix cache for hybrid models: a block trie plus exact-step state checkpoints.

Pure Python (standard library + xxhash): it deals in block ids, slot ids, token ids and steps and emits
copy plans (`CopyPlan`). The facade is `PrefixCache`; docs/cache.md describes its contract.
"""

from hybridcache.cache.config import CacheConfig, CostModel
from hybridcache.cache.events import CacheEvent, CacheEventLog, EventBatch, EventKind
from hybridcache.cache.integrity import IntegrityError
from hybridcache.cache.manager import PrefixCache
from hybridcache.cache.plan import CopyKind, CopyOp, CopyPlan, Phase, Pool
from hybridcache.cache.request import Admitted, CacheRequest, MatchResult, MultimodalSpan, Probe, SaveReason
from hybridcache.cache.sequence import PENDING_TOKEN
from hybridcache.cache.stats import CacheStats

__all__ = [
    "Admitted",
    "CacheConfig",
    "CacheEvent",
    "CacheEventLog",
    "CacheRequest",
    "CacheStats",
    "CopyKind",
    "CopyOp",
    "CopyPlan",
    "CostModel",
    "EventBatch",
    "EventKind",
    "IntegrityError",
    "MatchResult",
    "MultimodalSpan",
    "PENDING_TOKEN",
    "Phase",
    "Pool",
    "PrefixCache",
    "Probe",
    "SaveReason",
]
