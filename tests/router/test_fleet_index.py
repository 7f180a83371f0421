"""FleetIndex (the cache index replicas push to under Ray Serve): a snapshot, then events in order; an answer it
cannot apply (a replica it never saw, a restarted replica's new epoch, a malformed one) asks for a snapshot and
predicts nothing meanwhile; predictions equal a polled ReplicaIndex's; dropped replicas predict nothing."""

from __future__ import annotations

from hybridcache.cache.events import CacheEvent, EventKind
from hybridcache.cache.request import Probe
from hybridcache.cache.trie import chain_hash, root_hash
from hybridcache.router.fleet_index import FleetIndex
from hybridcache.router.index import ReplicaIndex, prompt_hashes

B = 4
PROMPT = [(5 * i + 3) % 97 for i in range(14)]


def _events() -> list[dict]:
    """The first two blocks of PROMPT, and a checkpoint at step 10 (anchor: block 2, tail: tokens 8..9)."""
    hashes = prompt_hashes(PROMPT, B)
    blocks = [CacheEvent(EventKind.BLOCK_STORED, block_hash=h, parent_hash=p, depth=i + 1)
              for i, (h, p) in enumerate(zip(hashes[:2], [root_hash(None), hashes[0]]))]
    checkpoint = CacheEvent(EventKind.CHECKPOINT_STORED, anchor_hash=hashes[1], step=10,
                            tail_hash=chain_hash(hashes[1], tuple(PROMPT[8:10]), ()))
    return [e.to_json() for e in (*blocks, checkpoint)]


def _answer(events: list[dict], reset: bool, next_seq: int, epoch: str = "e1") -> dict:
    return {"block_size": B, "full_prompt_hits": False, "reset": reset, "next": next_seq, "events": events,
            "epoch": epoch}


def test_snapshot_then_events_predict_as_a_polled_index():
    fleet, events = FleetIndex(), _events()
    assert fleet.publish("r1", _answer([], reset=False, next_seq=0)) is None  # never seen: a snapshot first
    assert fleet.predict([PROMPT], ["r1"]) == [Probe(0, 0)]
    assert fleet.publish("r1", _answer(events[:1], reset=True, next_seq=1)) == 1
    assert fleet.publish("r1", _answer(events[1:], reset=False, next_seq=3)) == 3
    polled = ReplicaIndex(B)
    polled.apply(CacheEvent.from_json(e) for e in events)
    expected = polled.predict(PROMPT)
    assert expected == Probe(kv_len=8, cached_len=10)
    assert fleet.predict([PROMPT], ["r1", "unknown"]) == [expected, Probe(0, 0)]
    assert fleet.predict([PROMPT, PROMPT[:11]], ["r1"]) == [Probe(16, 20)]  # summed over the prompts
    assert fleet.stats()["r1"] == {"up": True, "indexed_blocks": 2, "indexed_checkpoints": 1}
    fleet.drop(["r1"])
    assert fleet.predict([PROMPT], ["r1"]) == [Probe(0, 0)] and fleet.stats() == {}


def test_a_new_epoch_or_a_malformed_answer_asks_for_a_snapshot():
    fleet, events = FleetIndex(), _events()
    assert fleet.publish("r1", _answer(events, reset=True, next_seq=3)) == 3
    assert fleet.publish("r1", _answer([], reset=False, next_seq=0, epoch="e2")) is None  # restarted replica
    assert fleet.predict([PROMPT], ["r1"]) == [Probe(0, 0)]
    assert fleet.publish("r1", _answer(events, reset=True, next_seq=3, epoch="e2")) == 3
    assert fleet.predict([PROMPT], ["r1"])[0].cached_len == 10
    assert fleet.publish("r1", {"reset": True, "events": [{"kind": "nonsense"}]}) is None
    assert fleet.predict([PROMPT], ["r1"]) == [Probe(0, 0)]
    assert fleet.publish("r1", _answer(events, reset=True, next_seq=3)) == 3  # back from a snapshot
