"""The one place that reads the engine's memory and prefix-cache counters (so engine renames touch only this).

Everything here runs on the engine thread; the result is an immutable snapshot that any thread may read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineState:
    """A snapshot of the engine's memory and cache counters.

    weights: the weight format ("dense", "fp8-block128x128", "fp8-channel", "... (quantized at load)");
    kv_cache_dtype: the KV pool's dtype ("bfloat16", "fp8_e4m3", ...).

    num_blocks_used counts the pool's blocks held by running sequences and by the prefix cache (trie blocks,
    frozen tails, checkpoint states' pages); num_slots_used the runtime state slots of running sequences.
    `checkpoint_saves` (by reason), `checkpoint_hits` (by the reason of the checkpoint a hit restored),
    `declined_saves` (saves not made, by cause: 'policy' is learned admission, 'no_room' a full pool, ...) and
    `checkpoint_evictions` (by kind) are the cache's running totals since start; num_prefill_tokens counts
    prompt tokens computed; num_encoded_images the images the vision tower encoded and num_encoder_cache_hits
    those its encoder cache served instead (0 for a model without a vision tower). `spec_decode`: speculative
    decoding's totals (vLLM's spec_decode counters: verify rows `num_drafts`, `num_draft_tokens`,
    `num_accepted_tokens`, and `accepted_per_position`, position 1 first); None when it is off. Per tier (the
    host tier: `--host-cache-gib`; all 0 without one): `num_hits` (all hits) and `num_host_hits` (those promoted
    from the host), the host's blocks (`block_bytes` each, as the device's) and checkpoints, `num_promotions` /
    `num_demotions` (checkpoints copied to the device on a hit / moved to the host by eviction; trie blocks in
    `num_promoted_blocks` / `num_demoted_blocks`), `num_promotions_skipped` (a deeper host hit whose copy
    would have cost more than recomputing) and `num_host_dropped` (host checkpoints the host tier's own eviction
    dropped: gone, or to the disk tier). `disk`: the disk tier's counters (`DiskStats` and `num_not_kept`; None
    without one).
    num_blocks_running counts the distinct blocks that running sequences hold (shared prefix blocks once), a part
    of num_blocks_used.
    """

    weights: str = ""
    kv_cache_dtype: str = ""
    num_blocks: int = 0
    num_blocks_used: int = 0
    num_blocks_running: int = 0
    num_slots: int = 0
    num_slots_used: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_checkpoints: int = 0
    num_cache_nodes: int = 0
    num_preemptions: int = 0
    num_prefill_tokens: int = 0
    checkpoint_saves: dict[str, int] = field(default_factory=dict)
    checkpoint_hits: dict[str, int] = field(default_factory=dict)
    declined_saves: dict[str, int] = field(default_factory=dict)
    checkpoint_evictions: dict[str, int] = field(default_factory=dict)
    num_encoded_images: int = 0
    num_encoder_cache_hits: int = 0
    spec_decode: dict[str, Any] | None = None
    block_bytes: int = 0
    num_hits: int = 0
    num_host_hits: int = 0
    num_host_blocks: int = 0
    num_host_blocks_used: int = 0
    num_host_checkpoints: int = 0
    num_promotions: int = 0
    num_promoted_blocks: int = 0
    num_demotions: int = 0
    num_demoted_blocks: int = 0
    num_promotions_skipped: int = 0
    num_host_dropped: int = 0
    disk: dict[str, int] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_engine_state(engine: Any, num_blocks_running: int | None = None) -> EngineState:
    """Snapshot `engine` (an `LLMEngine`); call only from the thread that owns it. `num_blocks_running`: a
    recent count to reuse (None: count now; counting walks every running sequence's blocks)."""
    stats = engine.stats()
    cache = stats.get("cache")
    return EngineState(
        weights=stats.get("weights", ""),
        kv_cache_dtype=stats.get("kv_cache_dtype", ""),
        num_blocks=stats["num_blocks"],
        num_blocks_used=stats["num_blocks_used"],
        num_blocks_running=blocks_held_by_running(engine) if num_blocks_running is None else num_blocks_running,
        num_slots=stats["num_slots"],
        num_slots_used=stats["num_slots_used"],
        num_running=stats.get("num_running", 0),
        num_waiting=stats.get("num_waiting", 0),
        num_checkpoints=getattr(cache, "num_checkpoints", 0),
        num_cache_nodes=getattr(cache, "num_nodes", 0),
        num_preemptions=stats.get("num_preemptions", 0),
        num_prefill_tokens=stats.get("num_prefill_tokens", 0),
        checkpoint_saves=dict(getattr(cache, "saves_by_reason", {}) or {}),
        checkpoint_hits=dict(getattr(cache, "hits_by_reason", {}) or {}),
        declined_saves=dict(getattr(cache, "declined_saves", {}) or {}),
        checkpoint_evictions=dict(getattr(cache, "evictions_by_kind", {}) or {}),
        num_encoded_images=stats.get("num_encoded_images", 0),
        num_encoder_cache_hits=stats.get("num_encoder_cache_hits", 0),
        spec_decode=_spec_decode(stats.get("spec_decode")),
        block_bytes=stats.get("block_bytes", 0),
        num_hits=getattr(cache, "num_hits", 0),
        num_host_hits=getattr(cache, "num_host_hits", 0),
        num_host_blocks=stats.get("num_host_blocks", 0),
        num_host_blocks_used=getattr(cache, "num_host_blocks_used", 0),
        num_host_checkpoints=getattr(cache, "num_host_checkpoints", 0),
        num_promotions=getattr(cache, "num_promoted_checkpoints", 0),
        num_promoted_blocks=getattr(cache, "num_promoted_blocks", 0),
        num_demotions=getattr(cache, "num_demoted_checkpoints", 0),
        num_demoted_blocks=getattr(cache, "num_demoted_blocks", 0),
        num_promotions_skipped=getattr(cache, "num_promotions_skipped", 0),
        num_host_dropped=getattr(cache, "num_host_dropped", 0),
        disk=stats.get("disk"),
    )


def blocks_held_by_running(engine: Any) -> int:
    """The distinct pool blocks of the sequences the prefix cache runs (0 for an engine without one)."""
    cache = getattr(getattr(engine, "scheduler", None), "cache", None)
    if cache is None or not hasattr(cache, "running_ids"):
        return 0
    held: set[int] = set()
    for request_id in cache.running_ids():
        held.update(cache.block_ids(request_id))
    return len(held)


def _spec_decode(spec: Any) -> dict[str, Any] | None:
    """The speculative decoding counters as plain data (a copy: the engine keeps counting)."""
    if spec is None:
        return None
    return {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens,
            "accepted_per_position": list(spec.accepted_per_position)}


def check_engine(engine: Any, *, clear_cache: bool = False) -> EngineState:
    """Debug check (engine thread, idle engine): recompute every count from scratch (raises on a mismatch),
    optionally drop everything the prefix cache holds, and snapshot. After `clear_cache` on an idle engine,
    every block and slot must be free."""
    engine.check_integrity()
    if clear_cache:
        engine.clear_cache()
        engine.check_integrity()
    return read_engine_state(engine)
