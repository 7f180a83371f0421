"""`hybridcache serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand to the `hybridcache` command line."""
    from hybridcache.engine_args import add_engine_args

    serve = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--served-model-name", default=None, help="model id clients send (default: folder name)")
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20, help="request body size limit")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="seconds in-flight requests may run after SIGTERM before they are aborted")
    serve.add_argument("--enable-debug-endpoints", action="store_true",
                       help="serve GET /debug/engine (integrity check of an idle engine)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from hybridcache.config import EngineConfig
    from hybridcache.engine.engine import LLMEngine
    from hybridcache.engine_args import engine_options
    from hybridcache.models.builtin import BUILTIN_NAME
    from hybridcache.server.app import ServedModel, build_app
    from hybridcache.server.config import ServerConfig
    from hybridcache.server.engine_loop import EngineLoop
    from hybridcache.server.metrics import ServerMetrics
    from hybridcache.server.uvicorn_server import Server
    from hybridcache.tokenizer import Tokenizer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = engine_options(args)
    name = args.served_model_name or (Path(args.model).resolve().name if args.model else BUILTIN_NAME)
    config = ServerConfig(
        host=args.host, port=args.port, api_key=args.api_key, served_model_name=name,
        max_request_bytes=args.max_request_bytes, enable_debug_endpoints=args.enable_debug_endpoints,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    engine = LLMEngine(args.model, EngineConfig(**options))
    metrics = ServerMetrics()
    engine_loop = EngineLoop(engine, metrics)
    metrics.watch_engine(lambda: engine_loop.state)
    model = ServedModel(tokenizer=Tokenizer(engine.model_path), max_model_len=engine.max_model_len)
    app = build_app(engine_loop, model, config, metrics)
    server = Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=args.log_level, access_log=False,
        timeout_graceful_shutdown=config.shutdown_timeout_s, lifespan="on",
    ))
    server.run()
    return 0
