"""GET /v1/cache/events and POST /v1/cache/match on a real server: an index built from the events predicts
what the dry-run match reports, which is what the request then gets; a match changes nothing."""

from __future__ import annotations

import httpx

from hybridcache.cache import CacheEvent
from hybridcache.router.index import ReplicaIndex
from tests.server.conftest import MODEL
from tests.server.inprocess_server import serving


def _poll(client: httpx.Client, index: ReplicaIndex, since: int | None) -> int:
    params = {} if since is None else {"since": since}
    body = client.get("/v1/cache/events", params=params).raise_for_status().json()
    if body["reset"]:
        index.clear()
    index.apply(CacheEvent.from_json(e) for e in body["events"])
    return body["next"]


def test_events_and_dry_run_match_agree_with_the_hit(tokenizer):
    first = [(7 * i) % 250 for i in range(70)]
    second = first + [(11 * i) % 250 for i in range(30)]
    with serving(enable_debug_endpoints=True) as url, httpx.Client(base_url=url, timeout=60) as client:
        head = client.get("/v1/cache/events").raise_for_status().json()
        assert head["reset"] and head["events"] == [] and head["block_size"] == 16
        index = ReplicaIndex(head["block_size"])
        seq = head["next"]
        client.post("/v1/completions", json={"model": MODEL, "prompt": first, "max_tokens": 4}).raise_for_status()
        seq = _poll(client, index, seq)
        assert index.blocks and index.num_checkpoints > 0
        predicted = index.predict(second)
        assert predicted.cached_len >= len(first) - 1 and predicted.kv_len == 64
        before = client.get("/debug/engine").raise_for_status().json()["engine"]
        for _ in range(2):  # a dry run twice: same answer, nothing changed
            match = client.post("/v1/cache/match", json={"model": MODEL, "prompt": second}).raise_for_status().json()
            assert match["matches"] == [{"prompt_tokens": len(second), "kv_tokens": predicted.kv_len,
                                         "cached_tokens": predicted.cached_len}]
        assert client.get("/debug/engine").raise_for_status().json()["engine"] == before  # integrity ok, same counts
        out = client.post("/v1/completions", json={"model": MODEL, "prompt": second, "max_tokens": 2}).json()
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted.cached_len
        _poll(client, index, seq)
        fresh = ReplicaIndex(16)  # a reader from nothing gets a snapshot equal to the events so far
        _poll(client, fresh, None)
        assert fresh.blocks == index.blocks and fresh.checkpoints == index.checkpoints
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}
        match = client.post("/v1/cache/match", json=chat).raise_for_status().json()["matches"][0]
        ids = tokenizer.encode(tokenizer.apply_chat_template(chat["messages"]))
        assert match == {"prompt_tokens": len(ids), "kv_tokens": 0, "cached_tokens": 0}
        bad = client.post("/v1/cache/match", json={"model": MODEL, "prompt": 5})
        assert bad.status_code == 400 and "prompt" in bad.text
        assert client.get("/v1/cache/events", params={"since": 10**9}).status_code == 400
