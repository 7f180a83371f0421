"""Server options (the engine's own options live in `hybridcache.config.EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridcache.server.limits import DEFAULT_MAX_REQUEST_BYTES, ServerLimits
from hybridcache.server.reasoning import ReasoningParser
from hybridcache.server.tool_formats import tool_format

# logged at start-up by serve and the router when they listen beyond loopback with no API key (the host: %s)
NO_KEY_WARNING = ("listening on %s with no API key: anyone who can reach this address can use the server (set an API "
                  "key, or bind 127.0.0.1)")


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (only this machine can connect)."""
    return host in ("localhost", "::1") or host.startswith("127.")


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server runs.

    host / port: where to listen (loopback by default). api_key: when set, every /v1 request must send
    `Authorization: Bearer <api_key>`, or one of `other_api_keys` (vLLM's --api-key takes several; `api_keys` is
    all). served_model_name: the model id clients pass as `model` (and responses
    report); served_model_aliases: further ids clients may pass for the same model (`served_model_names` is all).
    max_request_bytes: request bodies above this are refused with 413 (default 256 MiB: the images one prompt
    may carry by default, as base64, and a long history; `limits.DEFAULT_MAX_REQUEST_BYTES`).
    enable_debug_endpoints: serve `GET /debug/engine` (integrity check and memory counters; off by default; it
    needs the API key when one is set). shutdown_timeout_s: on SIGTERM, how long in-flight requests may run
    before they are aborted
    (streams then end with an error event and `[DONE]`; `hybridcache serve` gives them all but the last 0.5 s,
    so that its process is gone within it). max_request_tokens: an opt-in budget of the tokens one request may
    ask for, n x max_tokens (a request without max_tokens then gets at most max_request_tokens // n per choice);
    None (the default, as vLLM): no budget beyond max_model_len.
    allowed_origins: origins whose browser pages may call the API (CORS; empty: no CORS headers, so
    browsers keep other origins out); "*" allows every origin. reasoning_parser: split chat completions'
    `<think>...</think>` into `reasoning_content` (None: the text stays in `content`). tool_call_parser: serve's
    `--tool-call-parser` (vLLM's name): the format tool calls are read in (`tool_formats.tool_format`; None: the
    Qwen blocks); an unknown name is a ValueError listing the known ones.
    default_chat_template_kwargs: template variables every chat request gets (`enable_thinking`, ...); a
    request's own `chat_template_kwargs` override them. force_include_usage: every stream ends with a usage
    chunk, as if it had asked with `stream_options.include_usage` (vLLM's `--enable-force-include-usage`).
    limits: what outside traffic may make the server hold (connections, read time, sequences per request,
    waiting sequences, run time; `limits.ServerLimits`).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    other_api_keys: tuple[str, ...] = ()
    served_model_name: str = "hybridcache"
    served_model_aliases: tuple[str, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    enable_debug_endpoints: bool = False
    shutdown_timeout_s: float = 10.0
    max_request_tokens: int | None = None
    allowed_origins: tuple[str, ...] = ()
    reasoning_parser: ReasoningParser | None = None
    tool_call_parser: str | None = None
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    force_include_usage: bool = False
    limits: ServerLimits = field(default_factory=ServerLimits)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every model id clients may send, the reported one first."""
        return (self.served_model_name, *self.served_model_aliases)

    @property
    def api_keys(self) -> tuple[str, ...]:
        """Every key a request may send, `api_key` first; empty when no key is needed."""
        return () if self.api_key is None else (self.api_key, *self.other_api_keys)

    def binds_loopback_only(self) -> bool:
        """Whether `host` is a loopback address (only this machine can connect)."""
        return is_loopback(self.host)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.max_request_tokens is not None and self.max_request_tokens < 1:
            raise ValueError(f"max_request_tokens must be >= 1, got {self.max_request_tokens}")
        object.__setattr__(self, "other_api_keys", tuple(self.other_api_keys))
        if self.other_api_keys and self.api_key is None:
            raise ValueError("other_api_keys need an api_key")
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        object.__setattr__(self, "served_model_aliases", tuple(self.served_model_aliases))
        if not all(self.served_model_aliases):
            raise ValueError("served model names must not be empty")
        if isinstance(self.reasoning_parser, str):
            object.__setattr__(self, "reasoning_parser", ReasoningParser(self.reasoning_parser))
        object.__setattr__(self, "default_chat_template_kwargs", dict(self.default_chat_template_kwargs))
        tool_format(self.tool_call_parser)  # (a ValueError naming the known parsers)
