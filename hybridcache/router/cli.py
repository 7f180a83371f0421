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
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

REPLICA_START_TIMEOUT_S = 600.0


def register(subparsers: argparse._SubParsersAction) -> None:
    from hybridcache.arg_types import http_url, port_number, positive_int
    from hybridcache.engine_args import HelpFormatter
    from hybridcache.server.limits import DEFAULT_MAX_REQUEST_BYTES, add_connection_args

    router = subparsers.add_parser("router", help="route OpenAI requests over replicas by where their checkpoints are",
                                   description="Serve the OpenAI API in front of `hybridcache serve` replicas, "
                                               "sending each request to the replica with the longest usable hit.",
                                   formatter_class=HelpFormatter)
    router.add_argument("--replica", action="append", required=True, metavar="URL", type=http_url,
                        help="base URL of a replica, e.g. http://127.0.0.1:8001 (repeatable)")
    router.add_argument("--model", default=None,
                        help="the replicas' model folder (its tokenizer and chat template predict hits; default: "
                             "the built-in model)")
    add_router_args(router)
    router.add_argument("--api-key", default=None,
                        help="the replicas' API key, for the router's own calls to them (default: "
                             "$HYBRIDCACHE_API_KEY when set); clients' keys are forwarded as sent")
    router.add_argument("--host", default="127.0.0.1", help="address to bind")
    router.add_argument("--port", type=port_number, default=8000, help="port to bind")
    router.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                        help="request body size limit (default: 256 MiB, as serve's: a replica's default body, "
                             "images as base64 included, passes the router)")
    add_connection_args(router)
    router.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="log level of the router and uvicorn")
    router.set_defaults(func=cmd_router)
    serve = subparsers.choices.get("serve")
    if serve is not None:
        serve.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                           help="run N engine processes (one device each; CPU ok) on ports PORT+1..PORT+N behind the "
                                "checkpoint-aware router on PORT (default: %(default)s: one engine, no router)")
        add_router_args(serve)
        serve.set_defaults(func=_serve_or_data_parallel(serve.get_default("func")))


def _serve_or_data_parallel(cmd_serve):
    """`serve`'s handler: `cmd_serve` for one engine, `serve_data_parallel` for several (the command line is
    this process's own: `sys.argv`)."""

    def run(args: argparse.Namespace) -> int:
        if args.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
        if args.data_parallel_size == 1:
            return cmd_serve(args)
        return serve_data_parallel(args, sys.argv[1:])

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


def router_config(args: argparse.Namespace, urls: Sequence[str]):
    from hybridcache.router.app import RouterConfig
    from hybridcache.router.policy import RoutingConfig
    from hybridcache.server.cli import api_key

    routing = RoutingConfig(args.routing, args.balance_abs_threshold, args.balance_rel_threshold, args.cache_threshold)
    return RouterConfig(tuple(urls), routing, poll_interval_s=args.router_poll_interval, api_key=api_key(args),
                        max_request_bytes=args.max_request_bytes)


def run_router(args: argparse.Namespace, urls: Sequence[str], model: str | None, host: str, port: int) -> None:
    """Serve the router on host:port with the server's connection guard (server/connections.py: a read deadline
    per request and a cap on open connections, from the parsed connection flags)."""
    import uvicorn

    from hybridcache.model_path import resolve_model
    from hybridcache.router.app import build_router_app
    from hybridcache.server import log_limits
    from hybridcache.server.connections import uvicorn_options
    from hybridcache.server.limits import limits_from_args
    from hybridcache.server.uvicorn_server import Server
    from hybridcache.tokenizer import Tokenizer

    config = router_config(args, urls)  # bad options fail before anything loads
    limits = limits_from_args(args)
    tokenizer = Tokenizer(resolve_model(model, weights=False).path)
    app = build_router_app(config, tokenizer)
    server = Server(uvicorn.Config(app, host=host, port=port, log_level=args.log_level, access_log=False,
                                   lifespan="on", **uvicorn_options(limits.connection_cap(),
                                                                    limits.request_read_timeout_s,
                                                                    limits.timeout_keep_alive_s)))
    log_limits.install()  # after uvicorn.Config, which sets up uvicorn's log handlers
    server.run()


def cmd_router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_router(args, args.replica, args.model, args.host, args.port)
    return 0


# ---- serve --data-parallel-size N ---------------------------------------------------------------------------


def replica_argv(argv: Sequence[str], port: int) -> list[str]:
    """The `serve` command line of one replica: `argv` (a `hybridcache serve ...` command line without the
    program) without --data-parallel-size, --host, --port and the routing options, plus a loopback port."""
    drop_with_value = {"--data-parallel-size", "--host", "--port", "--routing", "--balance-abs-threshold",
                       "--balance-rel-threshold", "--cache-threshold", "--router-poll-interval"}
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop_with_value:
            skip = "=" not in arg
            continue
        out.append(arg)
    return [*out, "--host", "127.0.0.1", "--port", str(port)]


def replica_env(environ: Mapping[str, str], index: int, size: int, on_cpu: bool) -> dict[str, str]:
    """The environment of replica `index` of `size`: GPU replica i sees one device, the i-th of
    CUDA_VISIBLE_DEVICES when set, else i. CPU replicas share the machine's cores: each runs an equal share of them
    as intra-op threads (OMP_NUM_THREADS, unless set already), since N processes of a thread per core make their
    OpenMP threads fight for the cores, as tensor-parallel ranks did (docs/bench.md). A ValueError when
    CUDA_VISIBLE_DEVICES lists fewer GPUs than replicas.

    Example: 8 cores, size 2 on the CPU: each replica gets OMP_NUM_THREADS=4."""
    env = dict(environ)
    if on_cpu:
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // size)))
        return env
    devices = environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(size))).split(",")
    if len(devices) < size:
        raise ValueError(f"--data-parallel-size {size} needs {size} devices; CUDA_VISIBLE_DEVICES lists "
                         f"{len(devices)}")
    env["CUDA_VISIBLE_DEVICES"] = devices[index]
    return env


def serve_data_parallel(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Start `args.data_parallel_size` replicas of this `serve` command (`replica_env`: one GPU each, or on the
    CPU an equal share of the cores each) on ports --port + 1 ... --port + N,
    wait until all answer /health, then run the router on --host:--port. Ends the replicas on exit."""
    import httpx

    from hybridcache.engine_args import AUTO, auto_device, model_argument

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("hybridcache.router")
    size = args.data_parallel_size
    on_cpu = (auto_device() if args.device == AUTO else args.device) == "cpu"
    ports = [args.port + 1 + i for i in range(size)]
    processes: list[subprocess.Popen] = []
    try:
        for i, port in enumerate(ports):
            env = replica_env(os.environ, i, size, on_cpu)
            command = [sys.executable, "-m", "hybridcache.cli", *replica_argv(argv, port)]
            processes.append(subprocess.Popen(command, env=env))
            log.info("replica %d: pid %d, port %d", i, processes[-1].pid, port)
        urls = [f"http://127.0.0.1:{port}" for port in ports]
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
        run_router(args, urls, model_argument(args), args.host, args.port)
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
            if process.poll() is None:
                process.kill()
    return 0
