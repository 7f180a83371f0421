"""Cache salts (vLLM's `cache_salt`): a salt is part of the trie root with the adapter, so requests share blocks and
checkpoints only under the same (adapter, salt), on the device, in the host tier and in what the disk may keep.
Every step runs on the fake device, whose identities include the root: a request served another salt's KV or
state fails its checks even where the hit counts would not show it."""

from __future__ import annotations

import pytest
import xxhash

from hybridcache.cache import CacheRequest, EventKind, PrefixCache, SaveReason
from hybridcache.cache.trie import RootKey, chain_hash, prompt_block_hashes, root_hash
from tests.cache.conftest import make_driver, tokens
from tests.cache.fake_engine import Driver
from tests.cache.test_host_tier import fill_device
from tests.cache.test_host_tier import make as make_host_tiered

B = 16


def save_at(driver: Driver, prompt: tuple[int, ...], step: int, rid: str = "src", **kw) -> None:
    """Prefill `prompt` with a chunk ending at `step` (a chunk_end save there), then abort it."""
    driver.admit(CacheRequest(rid, prompt, **kw))
    driver.step(rid, prompt[:step], [("chunk_end",)])
    driver.cache.abort(rid)
    driver.cache.check_integrity()


def found(cache: PrefixCache, request: CacheRequest) -> tuple[int, int, int]:
    """(cached_len, divergence_len, probe's kv_len) of `request`, the match released."""
    match = cache.match(request)
    cache.release_match(match)
    return match.cached_len, match.divergence_len, cache.probe(request).kv_len


@pytest.mark.parametrize("saved_salt", [None, "tenant-a"], ids=["saved-unsalted", "saved-salted"])
def test_only_the_same_salt_hits(saved_salt):
    driver = make_driver(block_size=B)
    prompt = tokens(3 * B, seed=1)
    save_at(driver, prompt, 2 * B + 5, cache_salt=saved_salt)
    for salt in (None, "tenant-a", "tenant-b", "tenant-a "):
        got = found(driver.cache, CacheRequest(f"r-{salt}", prompt, cache_salt=salt))
        # another root: no hit, no KV, and no branch point either (the divergence tells nothing of what is stored)
        assert got == ((2 * B + 5, 2 * B + 5, 2 * B) if salt == saved_salt else (0, 0, 0)), salt


def test_salt_and_adapter_are_one_root():
    driver = make_driver(block_size=B)
    prompt = tokens(2 * B + 3, seed=2)
    save_at(driver, prompt, B + 1, adapter="lora", cache_salt="s")
    for adapter, salt in ((None, "s"), ("lora", None), ("other", "s"), ("lora", "t")):
        assert found(driver.cache, CacheRequest("r", prompt, adapter=adapter, cache_salt=salt))[0] == 0
    assert found(driver.cache, CacheRequest("r", prompt, adapter="lora", cache_salt="s"))[0] == B + 1


def test_salts_share_no_block_and_each_shares_with_itself():
    driver = make_driver(block_size=B)
    cache = driver.cache
    prompt = tokens(3 * B + 4, seed=3)
    driver.run(CacheRequest("a1", prompt, cache_salt="a"), decode=[1, 2])
    nodes = cache.stats.num_nodes
    driver.run(CacheRequest("b1", prompt, cache_salt="b"), decode=[1, 2])
    assert cache.stats.num_nodes == 2 * nodes  # same tokens, another root: nothing deduplicated
    assert cache.stats.num_deduplicated_blocks == 0
    match = driver.run(CacheRequest("a2", prompt + (9,) * B, cache_salt="a"))
    assert match.cached_len >= len(prompt)  # the same salt hits its own turn's end
    roots = {key for key in cache._life.trie.roots}
    assert roots == {RootKey(None, "a"), RootKey(None, "b")}
    cache.check_integrity()


def test_a_salted_prompt_hashes_from_its_salted_root():
    prompt = tokens(2 * B, seed=4)
    plain = prompt_block_hashes(CacheRequest("p", prompt), B, chain_hash)
    salted = prompt_block_hashes(CacheRequest("s", prompt, cache_salt="x"), B, chain_hash)
    assert salted[0] == chain_hash(root_hash(None, "x"), prompt[:B], ())
    assert not set(plain) & set(salted)
    # unsalted roots hash as before salts existed (what the disk tier's files and the routers' indexes hold)
    assert root_hash(None) == xxhash.xxh64(b"None").intdigest() == root_hash(None, None)
    assert root_hash("lora") == xxhash.xxh64(b"'lora'").intdigest()
    hashes = {root_hash(a, s) for a in (None, "lora", "x") for s in (None, "lora", "x", "None")}
    assert len(hashes) == 12


@pytest.mark.parametrize("salt", ["", 7, b"salt"], ids=["empty", "int", "bytes"])
def test_a_salt_is_a_non_empty_string(salt):
    with pytest.raises(ValueError, match="cache_salt"):
        CacheRequest("r", (1, 2, 3), cache_salt=salt)


def test_reprs_keep_the_salt_out():
    """What lands in logs and error messages (reprs of requests, roots, nodes and the learner's ghost keys) never
    shows a salt: it is what keeps another tenant from hitting the prompts it guards."""
    driver = make_driver(block_size=B, admission="learned")
    request = CacheRequest("r", tokens(2 * B + 1, seed=8), cache_salt="secret-salt")
    driver.run(request)
    cache = driver.cache
    cache._learner.declined(SaveReason.CHUNK_END, None, (request.root_key, 0, 0), 3, request.prompt_ids[:3])
    shown = [request, request.root_key, *cache._life.trie.iter_nodes(), *cache._life.published(), cache._learner]
    assert all("secret-salt" not in repr(item) for item in shown)
    assert repr(request.root_key) == "RootKey(adapter=None, salted=True)"


def test_events_tell_salted_blocks_by_their_salted_hashes_and_never_the_salt():
    driver = make_driver(block_size=B)
    log = driver.cache.enable_events()
    prompt = tokens(2 * B + 2, seed=5)
    driver.run(CacheRequest("r", prompt, cache_salt="secret-salt"))
    events = log.since(0).events
    hashes = prompt_block_hashes(CacheRequest("q", prompt, cache_salt="secret-salt"), B, chain_hash)
    stored = [e for e in events if e.kind is EventKind.BLOCK_STORED]
    assert [e.block_hash for e in stored] == hashes
    assert stored[0].parent_hash == root_hash(None, "secret-salt")
    assert all("secret-salt" not in repr(e.to_json()) for e in [*events, *driver.cache.snapshot_events()])


def test_admission_keys_are_per_root():
    """The learned admission's ghosts and the branch-point policy's prefix keys are per root: a save declined for
    one salt is no ghost hit for another, and one salt's branch points do not count for another's."""
    driver = make_driver(block_size=B, admission="learned")
    cache = driver.cache
    prompt = tokens(B + 3, seed=6)
    a, b = (CacheRequest(salt, prompt, cache_salt=salt) for salt in ("a", "b"))
    assert cache._prefix_key(a, B + 1) != cache._prefix_key(b, B + 1)
    for salt in ("a", "b"):  # both roots exist (a match from a root that does not exist asks no ghost)
        driver.run(CacheRequest(f"warm-{salt}", tokens(5, seed=7), cache_salt=salt))
    cache._learner.declined(SaveReason.CHUNK_END, None, (a.root_key, 0, 0), 3, prompt[:3])
    driver.run(b)
    assert not cache._learner.kinds and cache._learner.num_ghosts == 1  # salt b's admission: not a's ghost
    driver.run(a)
    assert cache._learner.num_ghosts == 0 and cache._learner.kinds[(SaveReason.CHUNK_END, None)].uses == 1


# ---- the host tier and what may go behind it ----------------------------------------------------------------

def test_a_demoted_salted_checkpoint_hits_only_its_salt():
    cache, driver = make_host_tiered()
    prompt = tuple(range(10))
    driver.run(CacheRequest("a", prompt, cache_salt="a"))
    fill_device(driver)
    assert cache.stats.num_demoted_checkpoints >= 1
    host = cache._life.host
    assert any(c.salt == "a" for c in host.order.values())
    for salt in (None, "b"):
        assert found(cache, CacheRequest(f"x-{salt}", prompt + (1,), cache_salt=salt))[:2] == (0, 0)
        assert cache.probe(CacheRequest("p", prompt + (1,), cache_salt=salt)).cached_len == 0
    assert cache.probe(CacheRequest("p", prompt + (1,), cache_salt="a")).cached_len == 10
    match = driver.admit(CacheRequest("a2", prompt + (50, 51), cache_salt="a"))
    assert match.cached_len == 10  # promoted from the host tier
    driver.step("a2", [50, 51])
    cache.finish("a2")
    assert cache.stats.num_host_hits == 1
    cache.check_integrity()
    driver.device.check()


def test_salted_checkpoints_never_fall_out_to_a_tier_behind():
    """The disk tier keeps the base model's unsalted text only: a salted checkpoint the host drops is not handed
    to it (`fall_out` None), and it is never asked for a salted request."""
    cache, driver = make_host_tiered(host_blocks=6)
    kept, asked = [], []

    class Behind:
        def keep(self, fall_out):
            kept.append(fall_out)

        def find(self, request, block_size, max_step):
            asked.append(request.cache_salt)
            return []

        def read(self, stored, missing):
            return False

        def placed(self, stored, block_ids, state_ids):
            raise AssertionError("nothing is found")

        def clear(self):
            kept.clear()

    cache._life.attach_behind(Behind())
    driver.run(CacheRequest("s", tuple(range(10)), cache_salt="a"))
    driver.run(CacheRequest("u", tuple(range(20, 30))))
    for first in (100, 200, 300):
        fill_device(driver, first)
    assert cache._life.host.num_dropped >= 2
    assert None in kept and any(k is not None for k in kept)  # salted: not keepable; unsalted: handed on
    for ckpt in (c for c in cache._life.host.order.values()):
        assert (cache._life.host.fall_out(ckpt) is None) == (ckpt.salt is not None)
    asked.clear()
    cache.release_match(cache.match(CacheRequest("q", tuple(range(10)), cache_salt="a")))
    cache.release_match(cache.match(CacheRequest("q", tuple(range(10)))))
    assert asked == [None]  # the unsalted request only
    cache.check_integrity()


def test_roots_emptied_of_their_salts_things_are_forgotten():
    """A client may send a new salt with every request: each salt's root stayed in the trie for good, its blocks
    and checkpoints long evicted (2,000 salts: 2,001 roots, after a reset too). Emptied roots are swept once
    they double, and a reset forgets them all; the base model's unsalted root stays, and a salt whose things are
    still cached keeps its root and its hits."""
    driver = make_driver(block_size=B, num_blocks=24, num_slots=4)
    cache = driver.cache
    kept = tokens(2 * B + 3, seed=99)
    driver.run(CacheRequest("kept", kept, cache_salt="kept"))
    most = 0
    for i in range(500):
        driver.run(CacheRequest(f"r{i}", tokens(2 * B + 1, seed=i), cache_salt=f"salt-{i}"))
        most = max(most, len(cache._trie.roots))
        if i % 50 == 0:
            cache.check_integrity()
    assert most <= 2 * 64 + 2
    cache.check_integrity()
    cache.clear()
    assert set(cache._trie.roots) <= {RootKey(), RootKey(None, "kept")}
    again = CacheRequest("again", tokens(2 * B + 1, seed=7), cache_salt="salt-7")
    assert found(cache, again)[0] == 0  # a forgotten root: a miss, as on an empty one
    driver.run(again)
    assert found(cache, CacheRequest("third", (*tokens(2 * B + 1, seed=7), 5), cache_salt="salt-7"))[0] > 0
    cache.check_integrity()
