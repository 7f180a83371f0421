"""GET /v1/cache/events and POST /v1/cache/match on a real server: an index built from the events predicts
what the dry-run match reports, which is what the request then gets; a match changes nothing. /tokenize and the
match refuse a text too long to fit by its size, and tokenize off the event loop."""

from __future__ import annotations

import asyncio
import time

import httpx

from hybridcache.cache import CacheEvent
from hybridcache.router.index import ReplicaIndex
from hybridcache.server import cache_routes
from hybridcache.server.app import ServedModel, _Routes
from hybridcache.server.config import ServerConfig
from hybridcache.server.limits import max_token_bytes
from tests.server.conftest import MODEL, ThreadRecordingTokenizer
from tests.server.inprocess_server import ENGINE, serving


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


def test_reset_prefix_cache_as_vllm_online_and_offline():
    """vLLM's `POST /reset_prefix_cache` (its dev mode; here with --enable-debug-endpoints) and
    `LLM.reset_prefix_cache()`: after it, a resend hits nothing."""
    from hybridcache import LLM, SamplingParams

    prompt = [(7 * i) % 250 for i in range(70)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    with serving(enable_debug_endpoints=True) as url, httpx.Client(base_url=url, timeout=60) as client:
        client.post("/v1/completions", json=body).raise_for_status()
        assert client.post("/reset_prefix_cache").status_code == 200
        assert client.get("/debug/engine").json()["engine"]["num_blocks_used"] == 0
        again = client.post("/v1/completions", json=body).raise_for_status().json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    with serving() as url:  # a debug route: not served by default
        assert httpx.post(f"{url}/reset_prefix_cache", timeout=60).status_code == 404
    with LLM(block_size=16, max_model_len=256) as llm:
        params = SamplingParams(temperature=0, max_tokens=2)
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        assert llm.reset_prefix_cache()
        assert llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].num_cached_tokens == 0
        llm.engine.add_request("running", prompt, params)
        assert not llm.reset_prefix_cache()  # requests running: nothing dropped, as vLLM's


def test_tokenize_and_match_refuse_a_text_too_long_before_tokenizing_it(tokenizer):
    limit = ENGINE.max_model_len * max_token_bytes(tokenizer)
    text = "a" * (limit + 1)  # over the bound by its size alone; under the 1 MiB body limit
    assert limit + 1 < (1 << 20)
    with serving() as url, httpx.Client(base_url=url, timeout=60) as client:
        for path, body, param in (("/tokenize", {"prompt": text}, "prompt"),
                                  ("/v1/cache/match", {"model": MODEL, "prompt": text}, "prompt"),
                                  ("/v1/cache/match", {"model": MODEL, "messages": [{"role": "user", "content": text}]},
                                   "messages")):
            response = client.post(path, json=body)
            error = response.json()["error"]
            assert response.status_code == 400 and error["code"] == "context_length_exceeded", (path, error)
            assert error["param"] == param
        fits = client.post("/tokenize", json={"prompt": "hello there"}).raise_for_status().json()
        assert fits["tokens"] == tokenizer.encode("hello there")


def test_a_match_predicts_no_hit_for_a_request_that_computes_its_prompt_logprobs():
    """A request with prompt_logprobs (or echo with logprobs) computes every prompt position, so it gets 0 cached
    tokens, as in vLLM; the match predicted the full hit, not what the request then got (hunt 170). The router's
    predictor already knew (router/prompts.py)."""
    prompt = [(7 * i) % 250 for i in range(70)]
    with serving() as url, httpx.Client(base_url=url, timeout=60) as client:
        client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}).raise_for_status()
        plain = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        hit = client.post("/v1/cache/match", json=plain).raise_for_status().json()["matches"][0]
        assert hit["cached_tokens"] > 0
        for extra in ({"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}):
            body = {**plain, **extra}
            match = client.post("/v1/cache/match", json=body).raise_for_status().json()["matches"][0]
            usage = client.post("/v1/completions", json=body).raise_for_status().json()["usage"]
            assert match == {**hit, "cached_tokens": 0}, extra
            assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0, extra
        echo_only = {**plain, "echo": True}  # echo without logprobs still reads the cache
        assert client.post("/v1/cache/match", json=echo_only).raise_for_status().json()["matches"][0] == hit


def test_a_match_renders_and_tokenizes_on_the_tokenizer_threads(tokenizer):
    recording = ThreadRecordingTokenizer(tokenizer)
    threads = recording.threads
    routes = _Routes(None, ServedModel(tokenizer=recording, max_model_len=64), ServerConfig(), None)
    ids = asyncio.run(routes.body_prompt_ids({"prompt": ["hello", "there"]}))
    assert ids == [tokenizer.encode("hello"), tokenizer.encode("there")]
    assert threads[0] == "MainThread" and len(threads) == 3  # the warm-up call, then the two prompts
    assert all(name.startswith("hybridcache-tokenize") for name in threads[1:]), threads
    routes.tokenizer_pool.shutdown()


def test_an_image_is_no_text_in_a_predicted_prompt(tokenizer):
    """A chat predicted as text (the router, /v1/cache/match) keeps a stand-in where an image was: dropped, the
    texts around it met and matched a cached prompt without the image, a hit the replica then did not have (found
    by a bug hunt: 394 tokens predicted, 0 hit)."""
    from hybridcache.server.prompt_ids import IMAGE_STAND_IN, body_prompt_ids

    def chat(*parts):
        return {"messages": [{"role": "user", "content": list(parts)}]}

    text = {"type": "text", "text": "look: "}, {"type": "text", "text": "what is in the picture?"}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    without = body_prompt_ids(chat(*text), tokenizer)[0]
    with_image = body_prompt_ids(chat(text[0], image, text[1]), tokenizer)[0]
    first = next(i for i, (a, b) in enumerate(zip(without, with_image, strict=False)) if a != b)
    assert tokenizer.decode(with_image[first:]).startswith(IMAGE_STAND_IN)
    assert with_image != without and len(with_image) > len(without)


def test_a_paged_snapshot_equals_the_whole_one():
    """`paged=true`: the snapshot comes in pages of `limit` events, each but the last with a cursor to the next;
    together they are the whole snapshot (taken once, so its `next` holds across pages). A cursor read to its end,
    or made up, is refused."""
    prompts = [[(7 * i + k) % 250 for i in range(70)] for k in range(3)]
    with serving() as url, httpx.Client(base_url=url, timeout=60) as client:
        client.get("/v1/cache/events").raise_for_status()  # enables the log
        for prompt in prompts:
            client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}).raise_for_status()
        whole = client.get("/v1/cache/events").raise_for_status().json()
        assert whole["reset"] and len(whole["events"]) > 12 and "cursor" not in whole
        page = client.get("/v1/cache/events", params={"paged": "true", "limit": 5}).raise_for_status().json()
        pages = [page]
        while "cursor" in page:
            last_cursor = page["cursor"]
            page = client.get("/v1/cache/events", params={"cursor": last_cursor, "limit": 5}).raise_for_status().json()
            pages.append(page)
        assert [p["reset"] for p in pages] == [True] + [False] * (len(pages) - 1)
        assert all(len(p["events"]) == 5 for p in pages[:-1]) and 0 < len(pages[-1]["events"]) <= 5
        assert {(p["next"], p["epoch"], p["block_size"]) for p in pages} == {(whole["next"], whole["epoch"], 16)}
        assert [e for p in pages for e in p["events"]] == whole["events"]
        gone = client.get("/v1/cache/events", params={"cursor": last_cursor})
        assert gone.status_code == 409 and gone.json()["error"]["code"] == "snapshot_gone"
        assert client.get("/v1/cache/events", params={"cursor": "nonsense"}).status_code == 400
        small = client.get("/v1/cache/events", params={"paged": "true"}).raise_for_status().json()
        assert small["events"] == whole["events"] and "cursor" not in small  # one page holds it all


def test_a_snapshot_whose_reader_gave_up_is_dropped_in_time(monkeypatch):
    """A paged snapshot read to its first page only (its reader timed out or restarted) is dropped SNAPSHOT_KEEP_S
    after its last read: at the next events request of any kind, or by a timer with no request at all. It was held
    until the next paged snapshot or cursor read, which a router polling with `since` never sends (hunt 171: up to
    four 70 MB snapshots held for good)."""
    monkeypatch.setattr(cache_routes, "SNAPSHOT_KEEP_S", 0.3)
    made, init = [], cache_routes.CacheRoutes.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(cache_routes.CacheRoutes, "__init__", record)
    prompts = [[(7 * i + k) % 250 for i in range(70)] for k in range(3)]
    with serving() as url, httpx.Client(base_url=url, timeout=60) as client:
        client.get("/v1/cache/events").raise_for_status()  # enables the log
        for prompt in prompts:
            client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}).raise_for_status()
        first = client.get("/v1/cache/events", params={"paged": "true", "limit": 2}).raise_for_status().json()
        assert "cursor" in first
        (routes,) = made
        assert len(routes.snapshots) == 1
        time.sleep(0.5)
        client.get("/v1/cache/events", params={"since": first["next"]}).raise_for_status()
        assert not routes.snapshots  # an incremental poll dropped it
        client.get("/v1/cache/events", params={"paged": "true", "limit": 2}).raise_for_status()
        assert len(routes.snapshots) == 1
        deadline = time.monotonic() + 5
        while routes.snapshots and time.monotonic() < deadline:  # no request: the timer drops it (0.3 + 1 s)
            time.sleep(0.1)
        assert not routes.snapshots
