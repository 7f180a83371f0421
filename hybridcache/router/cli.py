"""`hybridcache router --replica URL ...` (the checkpoint-aware router) and `hybridcache serve
--data-parallel-size N` (N engine processes on one machine behind that router).

The `serve` subcommand belongs to server/cli.py; `register` (run after it, cli.py's `_SUBCOMMAND_MODULES`) adds
`--data-parallel-size` and the routing options to it and wraps its handler, so the server imports nothing of
the router (the router imports the server's request parsing)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

from hybridcache.extras import require_extra
from hybridcache.server.log_limits import REPLICA_INDEX_ENV, configure_logging

REPLICA_START_TIMEOUT_S = 600.0
# `serve --data-parallel-size N --request-timeout T`: the router waits T plus this for a replica, so that the
# replica's own answer at T (a 503 `request_timeout`, relayed as it is) comes first
REQUEST_TIMEOUT_GRACE_S = 5.0
# The `serve` flags of the public endpoint: given to the router, not to the loopback replicas
PUBLIC_FLAGS = ("--ssl-keyfile", "--ssl-certfile", "--root-path", "--allowed-origins", "--uds")
# The `serve` switches of the front's access log (`front_log_options`): the replicas' would log the router's polls
FRONT_SWITCHES = ("--enable-access-log", "--disable-uvicorn-access-log")
# `serve --data-parallel-size N --shutdown-timeout T`: the replicas get T less this, so that the streams they cut
# at the end of their grace period, with a final error event, reach the router before the end of its own
REPLICA_SHUTDOWN_MARGIN_S = 0.5
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def register(subparsers: argparse._SubParsersAction) -> None:
    from hybridcache.arg_types import (
        http_url,
        json_object,
        non_negative_float,
        port_number,
        positive_float,
        positive_int,
    )
    from hybridcache.engine_args import HelpFormatter
    from hybridcache.server.cli import SHUTDOWN_RESERVE_S, add_allowed_origins_arg
    from hybridcache.server.limits import DEFAULT_MAX_REQUEST_BYTES, add_connection_args

    router = subparsers.add_parser("router", help="route OpenAI requests over replicas by where their checkpoints are",
                                   description="Serve the OpenAI API in front of `hybridcache serve` replicas, "
                                               "sending each request to the replica with the longest usable hit.",
                                   formatter_class=HelpFormatter, allow_abbrev=False)
    router.add_argument("--replica", action="append", required=True, metavar="URL", type=http_url,
                        help="base URL of a replica, e.g. http://127.0.0.1:8001 (repeatable; user:password@ in it is "
                             "sent as basic auth and never shown)")
    router.add_argument("--model", default=None,
                        help="the replicas' model folder (its tokenizer and chat template predict hits; default: "
                             "the built-in model)")
    router.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="the replicas' --tokenizer, when they run with one (default: --model's)")
    router.add_argument("--chat-template", default=None, metavar="PATH",
                        help="the replicas' --chat-template, when they run with one (default: --model's)")
    router.add_argument("--chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                        help="the replicas' --chat-template-kwargs, when they run with them (default: none)")
    add_router_args(router)
    router.add_argument("--request-timeout", type=positive_float, default=None, metavar="SECONDS",
                        help="answer 504 when a replica sends nothing for this long, closing the request (the "
                             "replica aborts it; it is not sent to another one) (default: no limit, as serve's)")
    router.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                        help="the replicas' API keys: clients must send one of them, and the router's own calls "
                             "to the replicas send the first (default: $HYBRIDCACHE_API_KEY when set); clients' keys "
                             "are forwarded as sent")
    router.add_argument("--host", default="127.0.0.1", help="address to bind")
    router.add_argument("--port", type=port_number, default=8000, help="port to bind")
    router.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                        help="request body size limit (default: 256 MiB, as serve's: a replica's default body, "
                             "images as base64 included, passes the router)")
    add_connection_args(router)
    add_allowed_origins_arg(router, "the router")
    router.add_argument("--root-path", default="", metavar="PATH",
                        help="the path prefix under which a reverse proxy serves the router (default: none)")
    router.add_argument("--ssl-keyfile", default=None, metavar="PATH",
                        help="serve HTTPS with this key (with --ssl-certfile; default: plain HTTP)")
    router.add_argument("--ssl-certfile", default=None, metavar="PATH",
                        help="serve HTTPS with this certificate (with --ssl-keyfile; default: plain HTTP)")
    router.add_argument("--shutdown-timeout", type=non_negative_float, default=10.0, metavar="SECONDS",
                        help="the router is gone this many seconds after SIGTERM: requests in flight may run for all "
                             f"but the last {SHUTDOWN_RESERVE_S} s of it, then they are cut (as serve's)")
    router.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="log level of the router and uvicorn")
    router.set_defaults(func=cmd_router)
    serve = subparsers.choices.get("serve")
    if serve is not None:
        serve.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                           help="run N engine processes (one device each; CPU ok) on ports PORT+1..PORT+N behind the "
                                "checkpoint-aware router on PORT (default: %(default)s: one engine, no router)")
        add_router_args(serve)
        serve.set_defaults(func=_serve_or_data_parallel(serve.get_default("func")))


def _serve_or_data_parallel(cmd_serve):
    """`serve`'s handler: `cmd_serve` for one engine, `serve_data_parallel` for several (the command line is
    the one argparse read, `args.argv` (cli.py `parse_args`), else this process's own: `sys.argv`)."""

    def run(args: argparse.Namespace) -> int:
        if args.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
        if args.data_parallel_size == 1:
            return cmd_serve(args)
        _exit_now(serve_data_parallel(args, getattr(args, "argv", None) or sys.argv[1:]))

    return run


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """The routing options `router` and `serve --data-parallel-size` share."""
    from hybridcache.arg_types import non_negative_int, positive_float, ratio_at_least_one, unit_fraction
    from hybridcache.router.policy import ROUTER_POLICIES, RoutingConfig

    defaults = RoutingConfig()
    parser.add_argument("--routing", default=defaults.policy, choices=ROUTER_POLICIES,
                        help="checkpoint: longest usable hit (KV and a state); kv-prefix: most KV blocks; "
                             "round-robin (default: %(default)s)")
    parser.add_argument("--balance-abs-threshold", type=non_negative_int, default=defaults.abs_margin,
                        help="the best replica is skipped for the least-loaded one when it has more than this many "
                             "requests in flight more ... (default: %(default)s)")
    parser.add_argument("--balance-rel-threshold", type=ratio_at_least_one, default=defaults.rel_margin,
                        help="... and more than this many times as many (default: %(default)s)")
    parser.add_argument("--cache-threshold", type=unit_fraction, default=defaults.min_hit_fraction,
                        help="the best replica's predicted hit must cover this fraction of the prompt, else the "
                             "least-loaded replica is taken (default: %(default)s)")
    parser.add_argument("--router-poll-interval", type=positive_float, default=0.5, metavar="SECONDS",
                        help="seconds between polls of each replica's cache events (default: %(default)s)")


def router_config(args: argparse.Namespace, urls: Sequence[str], request_timeout_s: float | None = None):
    """The `RouterConfig` of the parsed `router` (or `serve --data-parallel-size`) options; `request_timeout_s`:
    the router's read timeout (`router --request-timeout`; for `serve`, `router_request_timeout`). Under `serve`,
    /metrics carries the replicas' own (`engine_metrics`): they listen on loopback only, where no Prometheus on
    another host reaches them."""
    from hybridcache.router.app import RouterConfig
    from hybridcache.router.policy import RoutingConfig
    from hybridcache.server.cli import api_keys

    keys = api_keys(args)
    routing = RoutingConfig(args.routing, args.balance_abs_threshold, args.balance_rel_threshold, args.cache_threshold)
    return RouterConfig(tuple(urls), routing, poll_interval_s=args.router_poll_interval,
                        api_key=keys[0] if keys else None, other_api_keys=keys[1:],
                        max_request_bytes=args.max_request_bytes, request_timeout_s=request_timeout_s,
                        chat_template_kwargs=args.chat_template_kwargs or {},
                        allowed_origins=tuple(args.allowed_origins or ()),
                        engine_metrics=hasattr(args, "data_parallel_size"))  # serve's flag (`router` has none)


def router_request_timeout(replica_timeout_s: float | None) -> float | None:
    """The router's read timeout in front of replicas that abort a request at `replica_timeout_s` (their
    `--request-timeout`): a little longer, so that the replica's own answer comes first; None for None."""
    return None if replica_timeout_s is None else replica_timeout_s + REQUEST_TIMEOUT_GRACE_S


def router_tokenizer(args: argparse.Namespace, model: str | None):
    """The tokenizer and chat template the replicas render with (server/cli.py `build_server`): `--tokenizer`'s
    folder, else the model's, with `--chat-template` over its own template. Bad flags fail before it loads."""
    from hybridcache.engine_args import resolve_engine_config
    from hybridcache.model_path import resolve_model
    from hybridcache.server.vllm_flags import chat_template
    from hybridcache.tokenizer import Tokenizer

    template = chat_template(args)  # a missing file fails first
    folder = resolve_model(model, weights=False).path
    if args.tokenizer is not None:  # resolved as the replicas' engine resolves it (a folder, or a hub id)
        folder = resolve_engine_config(folder, {"tokenizer": args.tokenizer, "device": "cpu"}).tokenizer
    tokenizer = Tokenizer(folder)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def run_router(args: argparse.Namespace, urls: Sequence[str], model: str | None, host: str, port: int,
               request_timeout_s: float | None = None, sock: socket.socket | None = None,
               on_shutdown: Callable[[], None] | None = None) -> None:
    """Serve the router on `sock` (bound here to host:port, or serve's --uds, when None) with the server's
    connection guard (server/connections.py: a read deadline per request and a cap on open connections, from the
    parsed connection flags), HTTPS, root path and CORS from the public-endpoint flags (`PUBLIC_FLAGS`), the
    replicas' tokenizer and chat template, and serve's graceful shutdown (--shutdown-timeout less
    `SHUTDOWN_RESERVE_S`); `on_shutdown` is called as the shutdown begins."""
    import uvicorn

    from hybridcache.router.app import build_router_app
    from hybridcache.server import log_limits
    from hybridcache.server.cli import SHUTDOWN_RESERVE_S
    from hybridcache.server.connections import uvicorn_options
    from hybridcache.server.limits import limits_from_args
    from hybridcache.server.uvicorn_server import Server, listen_socket
    from hybridcache.server.vllm_flags import check_vllm_args

    uds = getattr(args, "uds", None)  # serve's flag (`router` has none)
    if sock is None:
        sock = listen_socket(host, port, uds)  # a busy port fails before the tokenizer loads
    check_vllm_args(args)  # --ssl-keyfile and --ssl-certfile go together, and load
    config = router_config(args, urls, request_timeout_s)  # bad options fail before anything loads
    limits = limits_from_args(args)
    app = build_router_app(config, router_tokenizer(args, model))
    warn_without_key(config.api_key, host, uds)
    server = Server(uvicorn.Config(app, host=host, port=port, uds=uds, **front_log_options(args), lifespan="on",
                                   root_path=args.root_path, ssl_keyfile=args.ssl_keyfile,
                                   ssl_certfile=args.ssl_certfile,
                                   timeout_graceful_shutdown=max(0.0, args.shutdown_timeout - SHUTDOWN_RESERVE_S),
                                   **uvicorn_options(limits.connection_cap(), limits.request_read_timeout_s,
                                                     limits.timeout_keep_alive_s)), on_shutdown=on_shutdown)
    log_limits.install()  # after uvicorn.Config, which sets up uvicorn's log handlers
    server.run(sockets=[sock])


def front_log_options(args: argparse.Namespace) -> dict[str, object]:
    """The router's uvicorn log level and access log: serve's --uvicorn-log-level (default --log-level),
    --enable-access-log and --disable-uvicorn-access-log under `serve --data-parallel-size` (where the replicas
    get neither access flag, `replica_argv`: the access log is the front's, one line per client request with the
    client's address, not the replicas' lines of the router's own polls); `router`'s --log-level, no access log."""
    access_log = getattr(args, "enable_access_log", False) and not getattr(args, "disable_uvicorn_access_log", False)
    return {"log_level": getattr(args, "uvicorn_log_level", None) or args.log_level, "access_log": access_log}


def warn_without_key(api_key: str | None, host: str, uds: str | None = None) -> None:
    """Warn, as serve does (server/app.py), when the router listens on an address other than loopback with no API
    key: anyone who can reach it can use the replicas behind it."""
    from hybridcache.server.config import NO_KEY_WARNING, is_loopback

    if api_key is None and uds is None and not is_loopback(host):
        logging.getLogger("hybridcache.router").warning(NO_KEY_WARNING, host)


def cmd_router(args: argparse.Namespace) -> int:
    require_extra("serve", "hybridcache router")
    configure_logging(args.log_level)
    run_router(args, args.replica, args.model, args.host, args.port, args.request_timeout)
    _exit_now(0)


def _exit_now(status: int) -> NoReturn:
    """Exit with `status` once the router has shut down, the logs flushed, without the interpreter's teardown
    (as serve's, server/cli.py `_exit_now`): with torch loaded it takes about a second, past --shutdown-timeout."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# ---- serve --data-parallel-size N ---------------------------------------------------------------------------


def replica_argv(argv: Sequence[str], port: int, shutdown_timeout_s: float) -> list[str]:
    """The `serve` command line of one replica: `argv` (a `hybridcache serve ...` command line without the
    program, vLLM's spellings rewritten: `vllm_argv`) without --data-parallel-size (or -dp), --host, --port,
    --shutdown-timeout, the routing options, the public endpoint's (`PUBLIC_FLAGS`: HTTPS, root path, CORS and a
    Unix socket are the router's) and the access log's switches (`FRONT_SWITCHES`: the front logs the clients'
    requests), plus a loopback port and `shutdown_timeout_s` (`replica_shutdown_timeout`).
    Every --api-key value is kept: the replicas take the same keys.

    Example: `serve M --data-parallel-size 2 --ssl-keyfile k --allowed-origins a b --port 9000`, port 9001, 9.5 s:
    `serve M --host 127.0.0.1 --port 9001 --shutdown-timeout 9.5` (--allowed-origins takes every value up to the
    next flag)."""
    drop_with_value = {"--data-parallel-size", "-dp", "--host", "--port", "--shutdown-timeout", "--routing",
                       "--balance-abs-threshold", "--balance-rel-threshold", "--cache-threshold",
                       "--router-poll-interval", *PUBLIC_FLAGS}
    many_values = {"--allowed-origins"}  # nargs="+": every value up to the next option
    out: list[str] = []
    skip = 0  # 1: skip the next argument; 2: skip arguments up to the next option
    for arg in argv:
        if skip == 2 and not arg.startswith("-"):
            continue
        if skip == 1:
            skip = 0
            continue
        skip = 0
        name = arg.split("=", 1)[0]
        if name in FRONT_SWITCHES:
            continue
        if name in drop_with_value:
            skip = 0 if "=" in arg else 2 if name in many_values else 1
            continue
        out.append(arg)
    return [*out, "--host", "127.0.0.1", "--port", str(port), "--shutdown-timeout", str(shutdown_timeout_s)]


def replica_shutdown_timeout(shutdown_timeout_s: float) -> float:
    """The replicas' --shutdown-timeout behind a router given `shutdown_timeout_s`: `REPLICA_SHUTDOWN_MARGIN_S`
    less, so that they cut their streams (with a final error event) while the router still relays them, and are
    gone before the router's own deadline.

    Example: serve --data-parallel-size 2 --shutdown-timeout 3, SIGTERM at t = 0: the router stops accepting and
    sends each replica SIGTERM; the replicas cut their streams at 2 s and are gone by 2.5 s; the router cuts
    what is left at 2.5 s; the process is gone by 3 s."""
    return max(0.0, shutdown_timeout_s - REPLICA_SHUTDOWN_MARGIN_S)


def replica_env(environ: Mapping[str, str], index: int, size: int, on_cpu: bool,
                tensor_parallel_size: int = 1) -> dict[str, str]:
    """The environment of replica `index` of `size`: GPU replica i sees its `tensor_parallel_size` devices (one
    per rank, as vLLM's data-parallel engines each own TP GPUs), the i-th group of CUDA_VISIBLE_DEVICES when set,
    else of 0, 1, .... CPU replicas share the machine's cores: each runs an equal share of them as intra-op threads
    (OMP_NUM_THREADS, unless set already), since N processes of a thread per core make their OpenMP threads fight
    for the cores, as tensor-parallel ranks did (docs/bench.md). Each gets its index in `REPLICA_INDEX_ENV`, which
    its log lines show. A ValueError when CUDA_VISIBLE_DEVICES lists fewer GPUs than replicas x ranks.

    Examples: 8 cores, size 2 on the CPU: each replica gets OMP_NUM_THREADS=4. CUDA_VISIBLE_DEVICES=4,5,6,7, size 2,
    tensor_parallel_size 2: replica 0 sees "4,5", replica 1 "6,7"."""
    env = dict(environ)
    env[REPLICA_INDEX_ENV] = str(index)
    if on_cpu:
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // size)))
        return env
    needed = size * tensor_parallel_size
    devices = environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(needed))).split(",")
    if len(devices) < needed:
        raise ValueError(f"--data-parallel-size {size} x --tensor-parallel-size {tensor_parallel_size} needs "
                         f"{needed} devices; CUDA_VISIBLE_DEVICES lists {len(devices)}")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[index * tensor_parallel_size: (index + 1) * tensor_parallel_size])
    return env


class Replicas:
    """The replica processes of `serve --data-parallel-size N`. Each gets SIGTERM when this process dies, by
    SIGKILL too (`_die_with_parent`); `terminate` sends them all SIGTERM at once, once each (each then runs its own
    graceful shutdown: a second SIGTERM, once its server has stopped, would kill it in its disk hand-off) and sets
    the one deadline, `wait_s` on, by which `end` has them gone: SIGKILL to any left then. With `hand_off` (the
    replicas have a disk tier) there is no deadline: a replica's hand-off of its cache to disk comes after its
    shutdown timeout and is not bounded by it, as a single `serve`'s."""

    def __init__(self, wait_s: float, hand_off: bool = False) -> None:
        self.processes: list[subprocess.Popen] = []
        self.wait_s = wait_s
        self.hand_off = hand_off
        self.deadline: float | None = None
        self._signalled: list[subprocess.Popen] = []  # the processes sent SIGTERM

    def start(self, command: Sequence[str], env: Mapping[str, str],
              sock: socket.socket | None = None) -> subprocess.Popen:
        """Start `command`; with `sock` (its listening socket, bound here) the process inherits it as the file
        descriptor $HYBRIDCACHE_LISTEN_FD names (`server.uvicorn_server.inherited_socket`) and this process closes
        its own copy, so that the port closes when the replica ends."""
        from hybridcache.server.uvicorn_server import LISTEN_FD_ENV

        env, fds = dict(env), ()
        if sock is not None:
            env[LISTEN_FD_ENV], fds = str(sock.fileno()), (sock.fileno(),)
        try:
            process = subprocess.Popen(list(command), env=env, pass_fds=fds, preexec_fn=_die_with_parent(os.getpid()))
        finally:
            if sock is not None:
                sock.close()
        self.processes.append(process)
        return process

    def terminate(self) -> None:
        if self.deadline is None:
            self.deadline = float("inf") if self.hand_off else time.monotonic() + self.wait_s
        for process in self.processes:
            if process.poll() is None and process not in self._signalled:
                self._signalled.append(process)
                process.terminate()

    def end(self) -> None:
        self.terminate()
        while any(process.poll() is None for process in self.processes) and time.monotonic() < self.deadline:
            time.sleep(0.02)
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def _die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A `preexec_fn` after which the child gets SIGTERM when `parent_pid` (the process that starts it) dies, or
    at once when it has died already: Linux's PR_SET_PDEATHSIG. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it

    def set_parent_death_signal() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)

    return set_parent_death_signal


def serve_data_parallel(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Bind --host:--port (or --uds), start `args.data_parallel_size` replicas of this `serve` command
    (`replica_env`: one GPU per rank each, or on the CPU an equal share of the cores each) on ports
    --port + 1 ... --port + N, wait until all answer /health, then run the router. On SIGTERM the router's
    graceful shutdown and the replicas' run together (`replica_shutdown_timeout`); the replicas are gone within
    --shutdown-timeout less `SHUTDOWN_RESERVE_S` (with --disk-cache-dir: once their hand-off to disk is written, as
    a single serve's), and end with this process however it ends."""
    require_extra("serve", "hybridcache serve --data-parallel-size")
    from hybridcache.engine_args import AUTO, auto_device, model_argument
    from hybridcache.server.cli import SHUTDOWN_RESERVE_S, api_keys
    from hybridcache.server.uvicorn_server import listen_socket, remove_stale_socket, sigterm_interrupts

    configure_logging(args.log_level)
    api_keys(args)  # MODEL taken for a key fails before the port is bound and the replicas start
    log = logging.getLogger("hybridcache.router")
    size = args.data_parallel_size
    on_cpu = (auto_device() if args.device == AUTO else args.device) == "cpu"
    ports = [args.port + 1 + i for i in range(size)]
    if args.uds:
        remove_stale_socket(args.uds)
    sock = listen_socket(args.host, args.port, args.uds)  # a busy port fails before the replicas start
    replica_socks = _replica_sockets(ports)  # bound here, so that no other server can answer in a replica's place
    replicas = Replicas(max(0.0, args.shutdown_timeout - SHUTDOWN_RESERVE_S), hand_off=bool(args.disk_cache_dir))
    replica_timeout_s = replica_shutdown_timeout(args.shutdown_timeout)
    try:
        with sigterm_interrupts():
            for i, port in enumerate(ports):
                env = replica_env(os.environ, i, size, on_cpu, args.tensor_parallel_size)
                command = [sys.executable, "-m", "hybridcache.cli", *replica_argv(argv, port, replica_timeout_s)]
                log.info("replica %d: pid %d, port %d", i, replicas.start(command, env, replica_socks[i]).pid, port)
            urls = [f"http://127.0.0.1:{port}" for port in ports]
            _wait_healthy(replicas.processes, urls)
            run_router(args, urls, model_argument(args), args.host, args.port,
                       router_request_timeout(args.request_timeout), sock=sock, on_shutdown=replicas.terminate)
    except KeyboardInterrupt:
        log.info("interrupted: ending the replicas")
    finally:
        for replica_sock in replica_socks:
            replica_sock.close()  # those of replicas never started (closing twice is a no-op)
        replicas.end()
        if args.uds:
            remove_stale_socket(args.uds)
    return 0


def _replica_sockets(ports: Sequence[int]) -> list[socket.socket]:
    """Listening sockets on 127.0.0.1 at `ports`, one per replica; an OSError naming the replica whose port is
    taken (`serve --data-parallel-size 2 --port 8000` with another server on 8001 started replica 0, which could
    not bind and exited, while the parent's wait for /health took the other server's answer for replica 0's)."""
    from hybridcache.server.uvicorn_server import listen_socket

    socks: list[socket.socket] = []
    try:
        for i, port in enumerate(ports):
            try:
                socks.append(listen_socket("127.0.0.1", port))
            except OSError as error:
                raise OSError(f"{error} (replica {i}'s port: --data-parallel-size's replicas listen on --port + 1 "
                              f"... --port + {len(ports)})") from error
            socks[-1].listen()
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def _wait_healthy(processes: Sequence[subprocess.Popen], urls: Sequence[str]) -> None:
    """Return once every replica answers /health; an OSError when one exits or does not answer within
    `REPLICA_START_TIMEOUT_S`."""
    import httpx

    deadline = time.monotonic() + REPLICA_START_TIMEOUT_S
    for process, url in zip(processes, urls):
        while True:
            if process.poll() is not None:
                raise OSError(f"replica {url} exited with code {process.returncode} while starting")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise OSError(f"replica {url} did not answer /health within {REPLICA_START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
