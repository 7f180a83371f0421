"""The `vllm serve` flags that `hybridcache serve` takes as well, so that a vLLM command line starts it.

    --enable-auto-tool-choice      accepted: with tools, tool calls are always parsed ("auto" is the default)
    --tool-call-parser NAME        vLLM's name of the model's tool-call format (`tool_formats.TOOL_CALL_PARSERS`):
                                   hermes, granite4, qwen25, qwen3_coder, qwen3_xml read the Qwen `<tool_call>`
                                   blocks (as does no flag); nemotron_json NVIDIA's `<TOOLCALL>[...]` too; jamba,
                                   kimi_k2, lfm2, olmo3 and pythonic their families' formats (tool_formats.py)
    --chat-template PATH           a Jinja template file (or the template text itself, as vLLM takes it) that
                                   replaces the model folder's chat template
    --root-path PATH               the path prefix a reverse proxy serves the API under (uvicorn's root_path)
    --ssl-keyfile / --ssl-certfile serve HTTPS (both or neither; a file that cannot be loaded is refused, naming
                                   both, before the model loads)
    --uds PATH                     serve on this Unix socket instead of --host/--port (uvicorn's uds)
    --uvicorn-log-level LEVEL      uvicorn's own log level (default: --log-level)
    --disable-log-requests         accepted: the server never logs request contents (--enable-access-log
                                   writes one line per HTTP request)
    --disable-uvicorn-access-log   accepted: the access log is off unless --enable-access-log, and this turns it
                                   off even then
    --enable-force-include-usage   every stream ends with a usage chunk, asked for or not
    --enable-log-requests          accepted, a no-op (logged): request contents are never logged
    --enable-log-outputs           the same
    --max-log-len N                the same (vLLM's cut of logged prompts: nothing to cut)
    --reasoning-parser-plugin PATH, --tool-parser-plugin PATH
                                   accepted, no-ops (logged): no parser code is loaded; the names this server
                                   knows (--reasoning-parser nano_v3, NVIDIA's plugin name) are built in
    --language-model-only          text only, as vLLM's: a request with an image is refused (--limit-mm-per-prompt
                                   image 0); the vision tower's weights are still loaded

The engine's vLLM options (--seed, --tokenizer, --revision, --trust-remote-code, --swap-space, ...) are every
engine command's: `engine_args.VLLM_OPTIONS`.
"""

from __future__ import annotations

import argparse
import logging
import ssl
from pathlib import Path
from typing import Any

from hybridcache.server.tool_formats import TOOL_CALL_PARSERS

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

logger = logging.getLogger("hybridcache.server")


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    """Add the flags of the module docstring to the `serve` parser."""
    group = parser.add_argument_group("vLLM-compatible options")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM command lines: tool calls are always parsed when a request has tools")
    group.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                       help="vLLM's name of the model's tool-call format: hermes, granite4, qwen25, qwen3_coder "
                            "and qwen3_xml read the Qwen <tool_call> blocks (as does no flag), nemotron_json "
                            "NVIDIA's <TOOLCALL>[...] too; jamba, kimi_k2, lfm2, olmo3, pythonic their own")
    group.add_argument("--chat-template", default=None, metavar="PATH",
                       help="a Jinja chat template file (or the template text) that replaces the model folder's")
    group.add_argument("--root-path", default="", metavar="PATH",
                       help="the path prefix under which a reverse proxy serves the API")
    group.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="serve HTTPS with this key")
    group.add_argument("--ssl-certfile", default=None, metavar="PATH", help="serve HTTPS with this certificate")
    group.add_argument("--uds", default=None, metavar="PATH",
                       help="serve on this Unix domain socket instead of --host and --port")
    group.add_argument("--uvicorn-log-level", default=None, choices=_LOG_LEVELS,
                       help="uvicorn's log level (default: --log-level)")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="accepted for vLLM command lines: request contents are never logged")
    group.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="no access log, even with --enable-access-log (it is off by default)")
    group.add_argument("--enable-force-include-usage", action="store_true",
                       help="every stream ends with a usage chunk, even without stream_options.include_usage")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="accepted for vLLM command lines, a no-op (logged): request contents are never logged")
    group.add_argument("--enable-log-outputs", action="store_true",
                       help="accepted for vLLM command lines, a no-op (logged): outputs are never logged")
    group.add_argument("--max-log-len", type=int, default=None, metavar="N",
                       help="accepted for vLLM command lines, a no-op (logged): request contents are never logged")
    group.add_argument("--reasoning-parser-plugin", "--tool-parser-plugin", default=None, metavar="PATH",
                       dest="parser_plugin", help="accepted for vLLM command lines, a no-op (logged): no parser code "
                       "is loaded; the parser names this server knows are built in (--reasoning-parser nano_v3: "
                       "Qwen3's <think> rules)")
    group.add_argument("--language-model-only", action="store_true",
                       help="text only (vLLM's): requests with images are refused, as with --limit-mm-per-prompt "
                            "'{\"image\": 0}' (the vision tower's weights are still loaded)")


def check_vllm_args(args: argparse.Namespace) -> None:
    """Refuse inconsistent flags (SystemExit with the reason), and a key and certificate that do not load (a
    ValueError naming both files), before the model loads: uvicorn loads them only once the engine is up. A flag
    accepted as a no-op is logged (INFO), naming it."""
    for flag, given in (("--enable-log-requests", getattr(args, "enable_log_requests", False)),
                        ("--enable-log-outputs", getattr(args, "enable_log_outputs", False)),
                        ("--max-log-len", getattr(args, "max_log_len", None) is not None)):
        if given:
            logger.info("%s has no effect: the server never logs request contents or outputs "
                        "(--enable-access-log writes one line per HTTP request)", flag)
    if getattr(args, "parser_plugin", None):
        logger.info("--reasoning-parser-plugin / --tool-parser-plugin %s: not loaded (no parser code is loaded "
                    "here); --reasoning-parser and --tool-call-parser take the names this server has built in",
                    args.parser_plugin)
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise SystemExit("hybridcache serve: error: --ssl-keyfile and --ssl-certfile go together")
    if args.ssl_certfile:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        except ssl.SSLError as error:  # (an OSError too) not PEM, or the key is not the certificate's
            reason = f"not a PEM certificate and its private key ({error})"
        except OSError as error:
            reason = f"cannot read them: {error.strerror or error}"
        else:
            return
        raise ValueError(f"--ssl-certfile {args.ssl_certfile!r} with --ssl-keyfile {args.ssl_keyfile!r}: {reason}")


def chat_template(args: argparse.Namespace) -> str | None:
    """`--chat-template`: a file's text, or the argument itself when it names no file but looks like a
    template (vLLM takes both); None when unset. A missing file is a ValueError naming it."""
    value = args.chat_template
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if any(marker in value for marker in ("{{", "{%")):
        return value
    raise ValueError(f"--chat-template {value!r}: no such file (give a Jinja template file or the template text)")


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `uvicorn.Config` keywords these flags set (and serve's --enable-access-log)."""
    return {"root_path": args.root_path, "ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile,
            "log_level": args.uvicorn_log_level or args.log_level, "uds": args.uds,
            "access_log": args.enable_access_log and not args.disable_uvicorn_access_log}
