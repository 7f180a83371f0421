"""`hybridcache serve [MODEL]`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from hybridcache.server.config import ServerConfig

API_KEY_ENV = "HYBRIDCACHE_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # not read: named in a warning (`api_keys`)
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
# Of the shutdown grace period, what the end takes after in-flight requests are cancelled (uvicorn's pauses, the
# engine's last step and aborts), so that the process is gone within --shutdown-timeout of the signal.
SHUTDOWN_RESERVE_S = 0.5


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand to the `hybridcache` command line."""
    from hybridcache.arg_types import json_object, non_negative_float, port_number, positive_float, positive_int
    from hybridcache.engine_args import HelpFormatter, add_engine_args
    from hybridcache.generation_config import add_generation_config_arg
    from hybridcache.server.chat_images import add_media_flags
    from hybridcache.server.limits import DEFAULT_MAX_REQUEST_BYTES, add_limit_args
    from hybridcache.server.reasoning import ReasoningParser
    from hybridcache.server.vllm_flags import add_vllm_args

    serve = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API", formatter_class=HelpFormatter,
                                  description="Serve one model over an OpenAI-compatible HTTP API.",
                                  allow_abbrev=False)
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    serve.add_argument("--port", type=port_number, default=8000, help="port to bind")
    serve.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                       help=f"require 'Authorization: Bearer KEY' on /v1 routes, any one of the keys given (as vLLM; "
                            f"give MODEL before it) (default: ${API_KEY_ENV} when set, else no key)")
    serve.add_argument("--served-model-name", nargs="+", action="extend", default=None, metavar="NAME",
                       help="model ids clients may send; the first one is reported (default: MODEL as given)")
    serve.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                       help="request body size limit (default: 256 MiB, room for the default --limit-mm-per-prompt "
                            "images at 20 MB each as base64 and a long history)")
    serve.add_argument("--max-request-tokens", type=positive_int, default=None, metavar="N",
                       help="an opt-in budget of the tokens one request may ask for, n x max_tokens (default: no "
                            "budget beyond max_model_len, as vLLM)")
    add_allowed_origins_arg(serve, "the API")
    serve.add_argument("--shutdown-timeout", type=non_negative_float, default=10.0,
                       help="the process is gone this many seconds after SIGTERM: in-flight requests may run for "
                            f"all but the last {SHUTDOWN_RESERVE_S} s of it, then they are aborted")
    serve.add_argument("--enable-debug-endpoints", action="store_true",
                       help="serve GET /debug/engine (integrity check of an idle engine)")
    serve.add_argument("--reasoning-parser", default=None, choices=[parser.value for parser in ReasoningParser],
                       help="split <think>...</think> into reasoning (and reasoning_content) (default: off)")
    serve.add_argument("--chat-template-kwargs", "--default-chat-template-kwargs", type=json_object, default=None,
                       metavar="JSON", help="default chat_template_kwargs for every chat request, a JSON object, e.g. "
                       "'{\"enable_thinking\": false}' (vLLM's --default-chat-template-kwargs) (default: none; a "
                       "request's own keys win)")
    add_generation_config_arg(serve)
    add_limit_args(serve)
    serve.add_argument("--enable-access-log", action="store_true", help="log one line per HTTP request")
    serve.add_argument("--log-stats-interval", type=positive_float, default=10.0, metavar="SECONDS",
                       help="seconds between stats lines (throughput, cache hit rate, memory use)")
    add_media_flags(serve)
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="log level of the server and uvicorn")
    add_vllm_args(serve)
    serve.set_defaults(func=cmd_serve)


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """`--api-key`'s keys (several, as vLLM's: a request may send any one), else $HYBRIDCACHE_API_KEY's one key,
    else none. An empty value counts as unset, with a warning when no key is left: an empty key given on purpose
    would otherwise turn authentication off without a word. vLLM's $VLLM_API_KEY is not read (it may be a vLLM
    server's on the same machine): set with no key given, it is named in a warning. With no MODEL, a second key
    that names an existing file or folder or looks like a hub id (org/name) is a ValueError that does not show
    it: `serve --api-key K MODEL` takes MODEL for a key."""
    flag = [args.api_key] if isinstance(args.api_key, str) else list(args.api_key or ())
    given = [("--api-key", value) for value in flag] + [(f"${API_KEY_ENV}", os.environ.get(API_KEY_ENV))]
    keys = tuple(value for value in flag if value.strip())
    if not keys and given[-1][1] and given[-1][1].strip():
        keys = (given[-1][1],)
    empty = [name for name, value in given if value is not None and not value.strip()]
    log = logging.getLogger("hybridcache.server")
    if not keys and empty:
        log.warning("%s is empty: the server runs WITHOUT an API key (anyone who can connect may use it)", empty[0])
    elif not keys and os.environ.get(VLLM_API_KEY_ENV):
        log.warning("$%s is set but not read: the server runs WITHOUT an API key (give --api-key or $%s)",
                    VLLM_API_KEY_ENV, API_KEY_ENV)
    no_model = getattr(args, "model_arg", None) is None and getattr(args, "model", None) is None
    for number, key in enumerate(keys[1:] if no_model else (), start=2):
        if os.path.exists(os.path.expanduser(key)) or _HUB_ID.fullmatch(key):
            raise ValueError(f"--api-key's value {number} looks like MODEL (a folder or a hub id): --api-key takes "
                             "every value up to the next flag (several keys, as vLLM's); give MODEL before "
                             "--api-key, or as --model")
    return keys


def allowed_origin_list(text: str) -> list[str]:
    """`--allowed-origins`' type: one origin, or vLLM's form, a JSON list of origins (`'["https://a.example"]'`);
    a value starting with `[` that is not a JSON list of strings is refused."""
    if not text.lstrip().startswith("["):
        return [text]
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(origin, str) for origin in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of origins: {text!r} (e.g. '[\"https://a.example\"]', or "
                                         "the origins as separate values)")
    return value


class _ExtendEach(argparse.Action):
    """`nargs="+"` whose type gives a list per value: the lists are joined, across repeats of the flag too."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        joined = list(getattr(namespace, self.dest) or ())
        for value in values:
            joined.extend(value)
        setattr(namespace, self.dest, joined)


def add_allowed_origins_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """`--allowed-origins` of `serve` and `router` (`what`: what the pages may call)."""
    parser.add_argument("--allowed-origins", nargs="+", action=_ExtendEach, type=allowed_origin_list, default=None,
                        metavar="ORIGIN",
                        help=f"origins whose browser pages may call {what} (CORS; '*' for any), as separate values "
                             "or vLLM's JSON list '[\"https://a.example\"]' (default: none)")


def served_model_names(args: argparse.Namespace, model: str | None) -> tuple[str, ...]:
    """`--served-model-name`s, else the model argument as given, else the built-in model's name."""
    from hybridcache.models.builtin import BUILTIN_NAME

    if args.served_model_name:
        return tuple(args.served_model_name)
    return (model if model is not None else BUILTIN_NAME,)


def server_config(args: argparse.Namespace, names: tuple[str, ...]) -> ServerConfig:
    """The `ServerConfig` the parsed `serve` options describe (`names`: the served model names, reported first)."""
    from hybridcache.server.config import ServerConfig
    from hybridcache.server.limits import limits_from_args

    keys = api_keys(args)
    return ServerConfig(
        host=args.host, port=args.port, api_key=keys[0] if keys else None, other_api_keys=keys[1:],
        served_model_name=names[0],
        served_model_aliases=names[1:], max_request_bytes=args.max_request_bytes,
        enable_debug_endpoints=args.enable_debug_endpoints, shutdown_timeout_s=args.shutdown_timeout,
        max_request_tokens=args.max_request_tokens, allowed_origins=tuple(args.allowed_origins or ()),
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        default_chat_template_kwargs=args.chat_template_kwargs or {},
        force_include_usage=args.enable_force_include_usage, limits=limits_from_args(args),
    )


def served_media_limits(args: argparse.Namespace):
    """The `MediaLimits` of the parsed flags (ValueError naming a bad one): `--limit-mm-per-prompt`'s, no image at
    all with `--language-model-only` (vLLM's: every modality's limit 0)."""
    from hybridcache.server.chat_images import media_limits

    limits = media_limits(args)
    if args.language_model_only:
        return dataclasses.replace(limits, max_images=0, images_limited_by="--language-model-only: no images")
    return limits


@dataclass(frozen=True)
class ServerParts:
    """What `build_server` makes: the application (its lifespan starts and stops the engine thread), the engine
    and its loop, and the server config."""

    app: Any
    engine: Any
    engine_loop: Any
    config: ServerConfig


def build_server(args: argparse.Namespace) -> ServerParts:
    """The `serve` application the parsed options describe, with its engine loaded (not started); bad options
    and files fail before the model loads. `cmd_serve` runs it under uvicorn; the Ray Serve replica
    (router/ray_serve.py) calls it in process."""
    from hybridcache.engine.engine import LLMEngine
    from hybridcache.engine_args import engine_options, model_argument, model_options, resolve_engine_config
    from hybridcache.generation_config import SamplingDefaults
    from hybridcache.model_path import resolve_model
    from hybridcache.server.app import ServedModel, build_app
    from hybridcache.server.engine_loop import EngineLoop
    from hybridcache.server.limits import media_request_bytes
    from hybridcache.server.metrics import ServerMetrics
    from hybridcache.server.vllm_flags import chat_template, check_vllm_args
    from hybridcache.tokenizer import Tokenizer

    check_vllm_args(args)
    template = chat_template(args)  # a missing file fails before the model loads
    options = engine_options(args)
    options.pop("disable_log_stats")  # the server's own: it turns the stats lines off (below)
    model_arg = model_argument(args)
    names = served_model_names(args, model_arg)
    config = server_config(args, names)
    limits = served_media_limits(args)  # a bad flag fails before the model loads
    resolved = resolve_model(model_arg, **model_options(args))
    defaults = SamplingDefaults.from_model_dir(resolved.path, args.generation_config)  # a bad file fails first
    if defaults.as_dict():
        logging.getLogger("hybridcache.server").info(
            "sampling defaults from the model's generation_config.json: %s (--generation-config vllm ignores "
            "the file)", defaults.as_dict())
    engine = LLMEngine(resolved.path, resolve_engine_config(resolved.path, options))
    metrics = ServerMetrics(model_name=names[0], max_model_len=engine.max_model_len)
    engine_loop = EngineLoop(engine, metrics, stats_interval_s=None if args.disable_log_stats
                             else args.log_stats_interval, max_queued_requests=config.limits.max_queued_requests,
                             request_timeout_s=config.limits.request_timeout_s)
    metrics.watch_engine(lambda: engine_loop.state)
    tokenizer = Tokenizer(engine.config.tokenizer or engine.model_path)
    if template is not None:
        tokenizer.chat_template = template
    if engine.image_processor is not None and media_request_bytes(limits) > config.max_request_bytes:
        logging.getLogger("hybridcache.server").warning(
            "--max-request-bytes %d is less than the %d bytes that --limit-mm-per-prompt's %d images of up to %d "
            "bytes take as base64: raise it, or such requests get 413", config.max_request_bytes,
            media_request_bytes(limits), limits.max_images, limits.max_bytes)
    model = ServedModel(tokenizer=tokenizer, max_model_len=engine.max_model_len, sampling_defaults=defaults,
                        image_processor=engine.image_processor, media_limits=limits,
                        vocab_size=engine.model_config.vocab_size)
    return ServerParts(build_app(engine_loop, model, config, metrics), engine, engine_loop, config)


def cmd_serve(args: argparse.Namespace) -> int:
    from hybridcache.extras import require_extra

    require_extra("serve", "hybridcache serve")
    import uvicorn

    from hybridcache.server import log_limits
    from hybridcache.server.connections import uvicorn_options as connection_options
    from hybridcache.server.uvicorn_server import (
        Server,
        inherited_socket,
        listen_socket,
        remove_stale_socket,
        sigterm_interrupts,
    )
    from hybridcache.server.vllm_flags import uvicorn_options

    log_limits.configure_logging(args.log_level)  # httpx's INFO lines name every image URL fetched: muted
    api_keys(args)  # MODEL taken for a key fails before the port is bound
    sock = inherited_socket()  # a data-parallel replica's, bound by its parent
    if sock is None:
        if args.uds:
            remove_stale_socket(args.uds)
        sock = listen_socket(args.host, args.port, args.uds)  # a busy port or a bad host fails before the model loads
    try:
        with sigterm_interrupts():  # SIGTERM (or Ctrl-C) while the model loads ends the process, as PID 1 too
            parts = build_server(args)
    except KeyboardInterrupt:
        sock.close()
        if args.uds:
            remove_stale_socket(args.uds)
        logging.getLogger("hybridcache.server").info("interrupted while starting: exiting")
        return 0
    config = parts.config
    guard = config.limits
    server = Server(uvicorn.Config(
        parts.app, host=config.host, port=config.port,
        timeout_graceful_shutdown=max(0.0, config.shutdown_timeout_s - SHUTDOWN_RESERVE_S), lifespan="on",
        **uvicorn_options(args),
        **connection_options(guard.connection_cap(), guard.request_read_timeout_s, guard.timeout_keep_alive_s),
    ))
    log_limits.tag_replica_lines()  # after uvicorn.Config, which sets up uvicorn's log handlers
    log_limits.install()
    server.run(sockets=[sock])
    parts.engine_loop.stop()  # a no-op once the app's lifespan has stopped it
    if args.uds:
        remove_stale_socket(args.uds)  # as uvicorn.run does
    _exit_now(parts.engine)


def _exit_now(engine: Any) -> NoReturn:
    """End the process once the server has shut down: stop the engine (tensor-parallel workers included), flush
    the logs, and exit with status 0 without the interpreter's teardown, which takes seconds once torch is
    loaded and would run past the shutdown grace period (`--shutdown-timeout`)."""
    import sys

    engine.close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
