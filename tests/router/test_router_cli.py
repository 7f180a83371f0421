"""`hybridcache router` and `serve --data-parallel-size N`: the router renders with the replicas' tokenizer and chat
template, serves the public endpoint's HTTPS, root path and CORS (the loopback replicas get none of them), and
takes a request timeout (none by default; `serve`'s plus a grace)."""

from __future__ import annotations

import json
import shutil
import socket

import httpx
import pytest

from hybridcache.cli import build_parser
from hybridcache.models.builtin import builtin_model_dir, ensure_builtin_model
from hybridcache.router import cli as router_cli
from tests.router.serving import serving_app
from tests.router.test_faults import PROMPT, _fake_replica
from tests.server.test_lifecycle_server import self_signed_pair

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
ORIGIN = "http://app.example"


@pytest.fixture
def built_router(monkeypatch):
    """`run(argv, urls)`: parse `argv`, run the router as `run_router` does for it, and return (the app, the
    uvicorn config) without serving."""
    ensure_builtin_model()
    seen = {}
    monkeypatch.setattr("hybridcache.server.log_limits.install", lambda: None)  # global: not in the test process

    def served(server, sockets=None):
        for sock in sockets or ():
            sock.close()
        seen.update(config=server.config)

    def run(argv: list[str], urls: list[str], timeout_s: float | None = None, host: str = "127.0.0.1"):
        args = build_parser().parse_args(argv)
        with monkeypatch.context() as patch:  # (serving_app runs the same Server class)
            patch.setattr("hybridcache.server.uvicorn_server.Server.run", served)
            router_cli.run_router(args, urls, None, host, 0, timeout_s)
        return seen["config"].app, seen["config"]

    return run


def test_the_data_parallel_router_renders_with_the_replicas_chat_template_and_tokenizer(built_router, tmp_path):
    """`serve --data-parallel-size 2 --chat-template T`: the replicas render chats with T; the router rendered them
    with the model folder's template, so it predicted no hit anywhere (found by a bug hunt). `--tokenizer DIR` and
    `--chat-template-kwargs` likewise; `hybridcache router` takes the same three flags."""
    app, _ = built_router(["serve", "--data-parallel-size", "2", "--chat-template", TEMPLATE,
                           "--chat-template-kwargs", '{"enable_thinking": false}'], ["http://127.0.0.1:1"])
    assert app.state.router.tokenizer.chat_template == TEMPLATE
    assert app.state.router.config.chat_template_kwargs == {"enable_thinking": False}
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_model_dir() / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE + "{# own #}"}))
    app, _ = built_router(["serve", "--data-parallel-size", "2", "--tokenizer", str(folder)], ["http://127.0.0.1:1"])
    assert app.state.router.tokenizer.chat_template == TEMPLATE + "{# own #}"
    app, _ = built_router(["router", "--replica", "http://127.0.0.1:1", "--tokenizer", str(folder),
                           "--chat-template", TEMPLATE], ["http://127.0.0.1:1"])
    assert app.state.router.tokenizer.chat_template == TEMPLATE


@pytest.mark.parametrize("command", ["serve", "router"])
def test_https_root_path_and_cors_are_the_routers(built_router, command, tmp_path):
    """`serve --data-parallel-size 2 --ssl-keyfile K --ssl-certfile C --root-path P --allowed-origins O`: the
    replicas got those flags and the router none (TLS never came up, the parent polling replicas over http, and a
    browser's preflight got 405; found by a bug hunt). Now the router serves them; the replicas run plain on
    loopback."""
    key, cert = self_signed_pair(tmp_path)  # (loaded before the router starts)
    public = ["--ssl-keyfile", key, f"--ssl-certfile={cert}", "--root-path", "/api", "--allowed-origins", ORIGIN,
              "http://other.example"]
    head = ["serve", "--data-parallel-size", "2"] if command == "serve" else ["router", "--replica", "http://r:1"]
    app, config = built_router([*head, *public], ["http://127.0.0.1:1"])
    assert (config.ssl_keyfile, config.ssl_certfile, config.root_path) == (key, cert, "/api")
    if command == "serve":
        assert router_cli.replica_argv([*head, "--block-size", "16", *public, "--seed", "3"], 9001, 9.5) == [
            "serve", "--block-size", "16", "--seed", "3", "--host", "127.0.0.1", "--port", "9001",
            "--shutdown-timeout", "9.5"]
    with serving_app(_fake_replica("ok")) as replica:
        app, _ = built_router([*head, "--allowed-origins", ORIGIN], [replica])
        with serving_app(app) as router:
            preflight = httpx.options(f"{router}/v1/chat/completions", headers={
                "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type"})
            assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
            answer = httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT}, headers={"Origin": ORIGIN})
            assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN
    with pytest.raises(SystemExit, match="go together"):
        built_router([*head, "--ssl-keyfile", "k.pem"], ["http://127.0.0.1:1"])


def test_behind_a_root_path_requests_reach_the_replicas_routes():
    """Under uvicorn's root_path the request's path carries the prefix; the replicas serve the bare route."""
    from hybridcache.router.app import RouterConfig, build_router_app

    with serving_app(_fake_replica("ok")) as replica:
        router_app = build_router_app(RouterConfig((replica,), poll_interval_s=30.0), tokenizer=None)

        async def under_api(scope, receive, send):  # what uvicorn --root-path /api makes of a request
            if scope["type"] == "http":
                scope = {**scope, "root_path": "/api", "path": "/api" + scope["path"]}
            await router_app(scope, receive, send)

        with serving_app(under_api) as router:
            answer = httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT}, timeout=30)
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "ok"


def test_the_request_timeout_flags(built_router, monkeypatch):
    """`router --request-timeout T`: the router's read timeout (default none); `serve --data-parallel-size N
    --request-timeout T` gives the router T plus a grace, so that the replicas' own 503 at T comes first."""
    app, _ = built_router(["router", "--replica", "http://r:1"], ["http://127.0.0.1:1"])
    assert app.state.router.config.request_timeout_s is None
    args = build_parser().parse_args(["router", "--replica", "http://r:1", "--request-timeout", "7.5"])
    assert args.request_timeout == 7.5
    assert router_cli.router_request_timeout(None) is None
    assert router_cli.router_request_timeout(10.0) == 10.0 + router_cli.REQUEST_TIMEOUT_GRACE_S

    class Started:  # a replica process that is up at once
        pid, returncode = 1, None

        def poll(self):
            return self.returncode

        def terminate(self):
            self.returncode = 0

        def wait(self, timeout=None):
            return 0

    seen = {"commands": []}
    monkeypatch.setattr(router_cli.subprocess, "Popen", lambda command, env, preexec_fn, pass_fds:
                        seen["commands"].append(command) or Started())
    monkeypatch.setattr(httpx, "get", lambda url, timeout: httpx.Response(200))
    monkeypatch.setattr("hybridcache.server.uvicorn_server.listen_socket", lambda host, port, uds=None: socket.socket())
    monkeypatch.setattr(router_cli, "run_router", lambda args, urls, model, host, port, timeout_s, sock, on_shutdown:
                        seen.update(urls=urls, timeout_s=timeout_s))
    argv = ["serve", "--data-parallel-size", "2", "--device", "cpu", "--request-timeout", "10", "--port", "9000",
            "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"]
    assert router_cli.serve_data_parallel(build_parser().parse_args(argv), argv) == 0
    assert seen["timeout_s"] == 10.0 + router_cli.REQUEST_TIMEOUT_GRACE_S
    assert seen["urls"] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert [c[3:] for c in seen["commands"]] == [
        ["serve", "--device", "cpu", "--request-timeout", "10", "--host", "127.0.0.1", "--port", str(port),
         "--shutdown-timeout", "9.5"] for port in (9001, 9002)]


def test_router_flags_are_never_abbreviated_and_httpx_logs_only_warnings(capsys):
    """As every other subcommand: `--api` is not `--api-key` (it was taken as one). httpx logs each of the
    router's event polls at INFO (two a second per replica, idle or not): only its warnings are shown, but at
    debug."""
    import logging

    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--replica", "http://127.0.0.1:1", "--api", "x"])
    assert "unrecognized arguments: --api" in capsys.readouterr().err
    for level, wanted in (("info", logging.WARNING), ("debug", logging.DEBUG)):
        router_cli.configure_logging(level)
        assert logging.getLogger("httpx").level == logging.getLogger("httpcore").level == wanted


def test_the_front_logs_client_requests_at_the_uvicorn_log_level(built_router):
    """`serve --data-parallel-size 2 --enable-access-log`: the access log was the replicas' (the front had none):
    ~2 lines a second per replica of the router's own polls, clients shown with the router's loopback address.
    Now the front writes it, honours --uvicorn-log-level and --disable-uvicorn-access-log, and the replicas get
    neither access switch."""
    head = ["serve", "--data-parallel-size", "2"]
    urls = ["http://127.0.0.1:1"]
    _, config = built_router([*head, "--enable-access-log", "--uvicorn-log-level", "warning"], urls)
    assert config.access_log and config.log_level == "warning"
    _, config = built_router([*head, "--enable-access-log", "--disable-uvicorn-access-log"], urls)
    assert not config.access_log and config.log_level == "info"
    _, config = built_router([*head, "--log-level", "debug"], urls)
    assert not config.access_log and config.log_level == "debug"
    _, config = built_router(["router", "--replica", "http://r:1", "--log-level", "error"], urls)
    assert not config.access_log and config.log_level == "error"
    argv = [*head, "--enable-access-log", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    assert router_cli.replica_argv(argv, 9001, 9.5) == [
        "serve", "--uvicorn-log-level", "warning", "--host", "127.0.0.1", "--port", "9001", "--shutdown-timeout", "9.5"]


@pytest.mark.parametrize("command", ["serve", "router"])
def test_no_api_key_on_an_open_address_is_warned(built_router, command, caplog, monkeypatch):
    """As serve warns (server/app.py): the router, or serve --data-parallel-size's front, on a non-loopback address
    with no API key is open to anyone who reaches it (it said nothing)."""
    import logging

    monkeypatch.delenv("HYBRIDCACHE_API_KEY", raising=False)
    head = ["serve", "--data-parallel-size", "2"] if command == "serve" else ["router", "--replica", "http://r:1"]
    urls = ["http://127.0.0.1:1"]
    with caplog.at_level(logging.WARNING, logger="hybridcache.router"):
        built_router(head, urls, host="0.0.0.0")
        warned = [r.getMessage() for r in caplog.records if "no API key" in r.getMessage()]
        assert warned == ["listening on 0.0.0.0 with no API key: anyone who can reach this address can use the "
                          "server (set an API key, or bind 127.0.0.1)"]
        caplog.clear()
        built_router(head, urls)  # loopback
        built_router([*head, "--api-key", "k"], urls, host="0.0.0.0")
    assert not [r for r in caplog.records if "no API key" in r.getMessage()]
