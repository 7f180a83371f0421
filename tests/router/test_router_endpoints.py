"""The router serves the routes `serve` has besides generation (so that `serve --data-parallel-size N` is the same
API): /tokenize, /detokenize and /version from a replica that is up, /v1/cache/match from the replica the body
would be routed to, /ping and /load its own (each was a 404)."""

from __future__ import annotations

import logging

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse

from hybridcache.cache.events import CacheEvent, EventKind
from hybridcache.cache.trie import chain_hash, root_hash
from hybridcache.router.app import RouterConfig, build_router_app
from tests.router.serving import replica_app, serving_app
from tests.router.test_faults import PROMPT
from tests.server.server_process import free_port


def _replica(name: str, hit_step: int = 0):
    """A replica whose routes name it; its cache holds a checkpoint of PROMPT at `hit_step` (none for 0)."""
    app = replica_app()
    if hit_step:
        root = root_hash(None)
        app.state.events.append(CacheEvent(EventKind.CHECKPOINT_STORED, anchor_hash=root, step=hit_step,
                                           tail_hash=chain_hash(root, tuple(PROMPT[:hit_step]), ())).to_json())

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return {"tokens": [1, 2], "from": name, "auth": request.headers.get("authorization")}

    @app.post("/detokenize")
    async def detokenize():
        return {"prompt": "hi", "from": name}

    @app.get("/version")
    async def version():
        return {"version": "1.0"}

    @app.post("/v1/cache/match")
    async def match():
        return {"from": name}

    return app


def test_the_serve_routes_through_the_router():
    dead = f"http://127.0.0.1:{free_port()}"
    with serving_app(_replica("a")) as first, serving_app(_replica("b", hit_step=12)) as second:
        config = RouterConfig((dead, first, second), poll_interval_s=30.0)
        with serving_app(build_router_app(config, tokenizer=None)) as router:
            tokenized = httpx.post(f"{router}/tokenize", json={"prompt": "hi"},
                                   headers={"Authorization": "Bearer k"}, timeout=30)
            assert tokenized.status_code == 200
            assert tokenized.json() == {"tokens": [1, 2], "from": "a", "auth": "Bearer k"}
            assert httpx.post(f"{router}/detokenize", json={"tokens": [1]}, timeout=30).json()["from"] == "a"
            assert httpx.get(f"{router}/version", timeout=30).json() == {"version": "1.0"}
            # the replica holding PROMPT's checkpoint answers its dry run
            match = httpx.post(f"{router}/v1/cache/match", json={"prompt": PROMPT}, timeout=30)
            assert match.status_code == 200 and match.json() == {"from": "b"}
            for method in ("GET", "POST"):
                ping = httpx.request(method, f"{router}/ping", timeout=30)
                assert ping.status_code == 200 and ping.content == b""
            assert httpx.get(f"{router}/load", timeout=30).json() == {"server_load": 0}
    with serving_app(build_router_app(RouterConfig((dead,), poll_interval_s=30.0), tokenizer=None)) as router:
        assert httpx.get(f"{router}/ping", timeout=30).status_code == 503
        assert httpx.post(f"{router}/tokenize", json={"prompt": "hi"}, timeout=30).status_code == 503


def _model_replica(model: str):
    """A replica serving `model` whose completions name the model they ran (404 for another, as serve's)."""
    app = replica_app()
    app.state.calls = 0

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "max_model_len": 64}]}

    def refused(asked: str | None) -> JSONResponse | None:  # serve's _check_model
        if asked not in (None, model):
            return JSONResponse({"error": {"message": f"the model '{asked}' does not exist"}}, status_code=404)
        return None

    @app.post("/v1/completions")
    async def completions(request: Request):
        app.state.calls += 1
        return refused((await request.json()).get("model")) or {"model": model, "choices": [{"index": 0, "text": "ok"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return refused((await request.json()).get("model")) or {"tokens": [1, 2], "model": model}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return refused((await request.json()).get("model")) or {"prompt": "hi", "model": model}

    return app


def test_a_mixed_model_fleet_routes_by_model_and_lists_every_model(caplog):
    """Replicas of model-a and model-b: a request for model-b reaches a model-b replica (all went to the first
    replica, whose 404 came back), /v1/models lists both (it listed the first replica's), the router warns."""
    caplog.set_level(logging.WARNING, logger="hybridcache.router")
    a, b = _model_replica("model-a"), _model_replica("model-b")
    with serving_app(a) as first, serving_app(b) as second:
        config = RouterConfig((first, second), poll_interval_s=30.0)
        with serving_app(build_router_app(config, tokenizer=None)) as router:
            for model in ("model-b", "model-a", "model-b", None):
                body = {"prompt": PROMPT} if model is None else {"prompt": PROMPT, "model": model}
                response = httpx.post(f"{router}/v1/completions", json=body, timeout=30)
                assert response.status_code == 200 and response.json()["model"] in (model or "model-a", "model-b")
            assert (a.state.calls, b.state.calls) in ((1, 3), (2, 2))
            ids = [card["id"] for card in httpx.get(f"{router}/v1/models", timeout=30).json()["data"]]
            assert ids == ["model-a", "model-b"]
    assert any("serve different models" in r.getMessage() for r in caplog.records)


def test_tokenize_and_detokenize_go_to_a_replica_of_their_model():
    """Found by a bug hunt: /tokenize and /detokenize went to the first up replica whatever their `model`, and a
    replica of another model answered 404 model_not_found."""
    with serving_app(_model_replica("model-a")) as first, serving_app(_model_replica("model-b")) as second:
        config = RouterConfig((first, second), poll_interval_s=30.0)
        with serving_app(build_router_app(config, tokenizer=None)) as router:
            for route, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
                for model in ("model-b", "model-a", None):
                    sent = body if model is None else {**body, "model": model}
                    answer = httpx.post(f"{router}{route}", json=sent, timeout=30)
                    assert answer.status_code == 200 and answer.json()["model"] == (model or "model-a"), route


def test_a_keyless_request_is_refused_before_the_router_reads_it():
    """The router parsed, rendered and tokenized a request before the replica answered 401: keyless clients' big
    chats held up keyed ones on its tokenizer threads (hunt 181). With `api_key` it now answers 401 first, as a
    replica does; /version needs no key, as a replica's. CORS allows any request header (the OpenAI JS SDK sends
    X-Stainless-*), as vLLM's --allowed-headers default."""
    with serving_app(_replica("a")) as replica:
        config = RouterConfig((replica,), poll_interval_s=30.0, api_key="k", allowed_origins=("http://app",))
        with serving_app(build_router_app(config, tokenizer=None)) as router:
            keyed = {"Authorization": "Bearer k"}
            for path in ("/v1/chat/completions", "/v1/completions", "/v1/cache/match", "/tokenize", "/detokenize"):
                refused = httpx.post(f"{router}{path}", content=b"{not json", timeout=30)
                assert refused.status_code == 401, (path, refused.text)
                assert refused.json()["error"]["code"] == "invalid_api_key"
            assert httpx.post(f"{router}/tokenize", json={"prompt": "hi"}, timeout=30).status_code == 401
            tokenized = httpx.post(f"{router}/tokenize", json={"prompt": "hi"}, headers=keyed, timeout=30)
            assert tokenized.json()["from"] == "a"
            assert httpx.post(f"{router}/v1/cache/match", content=b"{", headers=keyed, timeout=30).status_code == 400
            assert httpx.get(f"{router}/version", timeout=30).json() == {"version": "1.0"}
            preflight = httpx.options(f"{router}/v1/chat/completions", timeout=30, headers={
                "Origin": "http://app", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type,x-stainless-lang,x-stainless-os"})
            assert preflight.status_code == 200, preflight.text
