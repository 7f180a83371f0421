"""What a client may make the router hold is bounded as for a replica: a body over --max-request-bytes is a 413
(and reaches no replica), the router runs uvicorn with the server's guarded protocol (a read deadline and a
connection cap), and /health shows the replicas' addresses and loads only with the API key (when one is set);
/metrics is open, as a replica's is."""

from __future__ import annotations

import base64

import httpx

from hybridcache.cli import build_parser
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.router import cli as router_cli
from hybridcache.router.app import ReplicaCredentials, RouterConfig, build_router_app
from hybridcache.server.limits import DEFAULT_MAX_REQUEST_BYTES
from tests.router.serving import serving_app
from tests.router.test_faults import PROMPT, _fake_replica
from tests.server.server_process import free_port


def test_a_body_over_the_limit_is_refused_before_any_replica_sees_it():
    replica = _fake_replica("ok")
    with serving_app(replica) as url:
        config = RouterConfig((url,), poll_interval_s=30.0, max_request_bytes=2000)
        with serving_app(build_router_app(config, tokenizer=None)) as router:
            big = {"prompt": PROMPT, "max_tokens": 1, "user": "x" * 3000}
            response = httpx.post(f"{router}/v1/completions", json=big, timeout=30)
            assert response.status_code == 413 and "the limit is 2000 bytes" in response.json()["error"]["message"]
            assert replica.state.calls == 0
            ok = httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=30)
            assert ok.status_code == 200 and replica.state.calls == 1


def test_health_details_need_the_key_and_metrics_are_open():
    with serving_app(_fake_replica("ok")) as url:
        config = RouterConfig((url,), poll_interval_s=30.0, api_key="k")
        with serving_app(build_router_app(config, tokenizer=None)) as router:
            anonymous = httpx.get(f"{router}/health").json()
            assert anonymous == {"status": "ok"}
            keyed = httpx.get(f"{router}/health", headers={"Authorization": "Bearer k"}).json()
            assert [r["url"] for r in keyed["replicas"]] == [url]
            assert httpx.get(f"{router}/health", headers={"Authorization": "Bearer wrong"}).json() == anonymous
            assert "hybridcache_router_requests_routed_total" in httpx.get(f"{router}/metrics").text


def test_the_router_runs_with_the_connection_guard(monkeypatch):
    ensure_builtin_model()
    seen = {}

    def capture(server, sockets=None) -> None:
        for sock in sockets or ():
            sock.close()
        seen["config"] = server.config

    monkeypatch.setattr("hybridcache.server.uvicorn_server.Server.run", capture)
    monkeypatch.setattr("hybridcache.server.log_limits.install", lambda: None)  # global: not in the test process
    args = build_parser().parse_args(["router", "--replica", "http://127.0.0.1:1", "--limit-concurrency", "7",
                                      "--request-read-timeout", "3", "--max-request-bytes", "4096"])
    router_cli.run_router(args, args.replica, None, "127.0.0.1", 0)
    config = seen["config"]
    assert config.http.__name__ == "GuardedH11Protocol" and config.timeout_keep_alive == 5.0
    assert router_cli.router_config(args, args.replica).max_request_bytes == 4096


def test_the_router_takes_the_bodies_a_replica_takes_by_default():
    """The router's body limit was 1 MiB while `serve`'s is 256 MiB: an image request a replica takes got 413 at
    the router. Both defaults are `DEFAULT_MAX_REQUEST_BYTES` now."""
    args = build_parser().parse_args(["router", "--replica", "http://127.0.0.1:1"])
    assert router_cli.router_config(args, args.replica).max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    assert RouterConfig(("http://127.0.0.1:1",)).max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    serve = build_parser().parse_args(["serve"])
    assert serve.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES == 256 << 20


def test_credentials_in_a_replica_url_are_sent_never_shown():
    """`--replica http://admin:s3cret@host:port`: the router authenticates with them (basic auth, as httpx does
    with a URL's userinfo) but shows the replica as http://host:port in errors, /health and /metrics labels (the
    secret reached every client in 502/503 messages and the open /metrics)."""
    replica = _fake_replica("ok")
    seen = []

    @replica.middleware("http")
    async def record(request, call_next):
        if request.url.path != "/health":  # (the test's own wait for the replica)
            seen.append(request.headers.get("authorization"))
        return await call_next(request)

    dead = f"http://admin:s3cret@127.0.0.1:{free_port()}"
    with serving_app(replica) as url:
        keyed = url.replace("http://", "http://admin:s3cret@")
        config = RouterConfig((keyed, dead), poll_interval_s=30.0)
        with serving_app(build_router_app(config, tokenizer=None)) as router:
            response = httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=30)
            assert response.status_code == 200
            texts = [httpx.get(f"{router}/metrics").text, httpx.get(f"{router}/health").text]
            assert f'replica="{url}"' in texts[0]
        with serving_app(build_router_app(RouterConfig((dead,), poll_interval_s=30.0), tokenizer=None)) as router:
            texts.append(httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT}, timeout=30).text)
    assert all("s3cret" not in text for text in texts), texts
    assert seen and all(header == "Basic YWRtaW46czNjcmV0" for header in seen), seen


def test_replicas_behind_one_proxy_each_get_their_own_credentials():
    """Found by a bug hunt: credentials were keyed by origin, so two replicas behind one proxy under path prefixes
    (each location with its own user) both got the last one's, and the first one's polls failed (401). A request
    now gets the credentials of the longest replica base URL it is under, none when that replica has none."""
    urls = ("http://alice:a@proxy:8080/replica-a", "http://bob:b@proxy:8080/replica-b",
            "http://root:r@proxy:8080", "http://proxy:8080/open", "http://carol:c@other:8080/replica-a")
    auth = ReplicaCredentials(urls)

    def sent(url: str) -> str | None:
        header = next(auth.auth_flow(httpx.Request("GET", url))).headers.get("authorization")
        return base64.b64decode(header.split()[1]).decode() if header else None

    assert [sent(url) for url in ("http://proxy:8080/replica-a/v1/cache/events", "http://proxy:8080/replica-b/ping",
                                  "http://proxy:8080/replica-ab/v1/models", "http://proxy:8080/v1/models",
                                  "http://proxy:8080/open/v1/cache/events", "http://other:8080/replica-a/health",
                                  "http://other:8080/health")] == ["alice:a", "bob:b", "root:r", "root:r", None,
                                                                   "carol:c", None]
