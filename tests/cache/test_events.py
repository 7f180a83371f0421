"""Cache events and the dry-run probe: an index rebuilt from the events predicts exactly what the cache
would match, under eviction; a probe changes nothing; the event log is bounded and says when it lost events."""

from __future__ import annotations

import random

import pytest

from hybridcache.cache import CacheEvent, CacheEventLog, CacheRequest, EventKind
from hybridcache.router.index import ReplicaIndex
from tests.cache.conftest import make_driver, tokens
from tests.cache.fake_engine import fingerprint

B = 16


def _workload(rng: random.Random, num_requests: int) -> list[tuple[int, ...]]:
    """Conversations (each turn extends the last) over a few shared system prompts, plus one-off prompts."""
    systems = [tokens(rng.randrange(5, 60), seed=100 + i) for i in range(3)]
    chats: list[tuple[int, ...]] = []
    prompts = []
    for _ in range(num_requests):
        if chats and rng.random() < 0.5:
            i = rng.randrange(len(chats))
            chats[i] = chats[i] + tokens(rng.randrange(1, 40), seed=rng.randrange(10**6))
            prompts.append(chats[i])
        else:
            chats.append(rng.choice(systems) + tokens(rng.randrange(1, 50), seed=rng.randrange(10**6)))
            prompts.append(chats[-1])
    return prompts


def _probe_prompts(rng: random.Random, seen: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Prompts to predict: cut or extended earlier prompts (hits at many steps) and fresh ones (misses)."""
    out = [tokens(30, seed=rng.randrange(10**6))]
    for prompt in rng.sample(seen, min(6, len(seen))):
        out.append(prompt[:rng.randrange(1, len(prompt) + 1)] + tokens(rng.randrange(1, 20), seed=rng.randrange(9)))
    return out


@pytest.mark.parametrize("num_blocks", [24, 64, 512], ids=lambda n: f"blocks{n}")
def test_index_from_events_predicts_every_probe(num_blocks):
    """Replayed into a `ReplicaIndex`, the events give the same (kv_len, cached_len) as `probe` for every
    prompt, while blocks and checkpoints come and go (small pools force evictions)."""
    rng = random.Random(num_blocks)
    driver = make_driver(block_size=B, num_blocks=num_blocks, num_slots=12)
    cache = driver.cache
    log = cache.enable_events()
    index = ReplicaIndex(B)
    seq = 0
    seen: list[tuple[int, ...]] = []
    num_hits = 0
    for k, prompt in enumerate(_workload(rng, 60)):
        driver.run(CacheRequest(f"r{k}", prompt), decode=[7, 8, 9][:rng.randrange(4)], chunk=rng.choice([None, 24]),
                   branch=True)
        seen.append(prompt)
        batch = log.since(seq)
        assert not batch.lost
        index.apply(batch.events)
        seq = batch.next_seq
        for probe_prompt in _probe_prompts(rng, seen):
            probe = cache.probe(CacheRequest("p", probe_prompt))
            assert index.predict(probe_prompt) == probe, (k, len(probe_prompt))
            num_hits += probe.cached_len > 0
    assert num_hits > 20  # the comparison covered hits, not just misses
    assert sum(cache.stats.evictions_by_kind.values()) > 0 or num_blocks == 512
    snapshot = ReplicaIndex(B)
    snapshot.apply(cache.snapshot_events())
    assert snapshot.blocks == index.blocks and snapshot.checkpoints == index.checkpoints
    cache.check_integrity()


def test_probe_changes_nothing():
    """A dry run leaves counts, pins, LRU times, stats and pending matches exactly as they were."""
    driver = make_driver(block_size=B)
    prompt = tokens(5 * B + 3, seed=4)
    driver.run(CacheRequest("a", prompt), decode=[1, 2], chunk=2 * B)
    driver.run(CacheRequest("b", tokens(3 * B, seed=5)))
    cache = driver.cache
    before = fingerprint(cache)
    probe = cache.probe(CacheRequest("q", prompt + (1, 2, 3)))
    assert probe.cached_len == len(prompt) + 2 and probe.kv_len == 5 * B  # finish: both decode tokens fed
    assert cache.probe(CacheRequest("q2", prompt[:2 * B + 5] + (99,))).cached_len == 2 * B
    assert fingerprint(cache) == before
    cache.check_integrity()
    match = cache.match(CacheRequest("q", prompt + (1, 2, 3)))  # the real match agrees, and does pin
    assert match.cached_len == probe.cached_len
    assert fingerprint(cache) != before
    cache.release_match(match)


def test_events_of_a_hit_and_an_eviction():
    """A finished request stores its blocks then its checkpoint; clearing removes both, each with the hashes
    the stored events named."""
    driver = make_driver(block_size=B)
    cache = driver.cache
    log = cache.enable_events()
    driver.run(CacheRequest("a", tokens(2 * B + 5, seed=6)), chunk=B)
    kinds = [e.kind for e in log.since(0).events]
    assert kinds.count(EventKind.BLOCK_STORED) == 2
    assert kinds.count(EventKind.CHECKPOINT_STORED) == 3  # two chunk ends and the finish
    stored = log.since(0).events
    start = log.next_seq
    cache.clear()
    removed = log.since(start).events
    assert {e.block_hash for e in removed if e.kind is EventKind.BLOCK_REMOVED} == {
        e.block_hash for e in stored if e.kind is EventKind.BLOCK_STORED}
    assert sorted((e.anchor_hash, e.step, e.tail_hash) for e in removed if e.kind is EventKind.CHECKPOINT_REMOVED) \
        == sorted((e.anchor_hash, e.step, e.tail_hash) for e in stored if e.kind is EventKind.CHECKPOINT_STORED)
    assert cache.snapshot_events() == []


def test_event_log_is_bounded_and_reports_loss():
    log = CacheEventLog(capacity=3)
    for i in range(5):
        log.emit(CacheEvent(EventKind.BLOCK_REMOVED, block_hash=i))
    batch = log.since(0)
    assert batch.lost and batch.first == 2 and batch.next_seq == 5
    assert [e.block_hash for e in batch.events] == [2, 3, 4]
    assert not log.since(3).lost and [e.block_hash for e in log.since(3, limit=1).events] == [3]
    assert log.since(5).events == ()
    with pytest.raises(ValueError, match="outside"):
        log.since(6)
    event = CacheEvent(EventKind.CHECKPOINT_STORED, anchor_hash=1, step=20, tail_hash=3, adapter="a")
    assert CacheEvent.from_json(event.to_json()) == event
    with pytest.raises(ValueError, match="malformed"):
        CacheEvent.from_json({"kind": "nope"})
