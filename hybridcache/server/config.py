"""Server options (the engine's own options live in `hybridcache.config.EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP server runs.

    host / port: where to listen (loopback by default). api_key: when set, every /v1 request must send
    `Authorization: Bearer <api_key>`. served_model_name: the model id clients pass as `model`.
    max_request_bytes: request bodies above this are refused with 413. enable_debug_endpoints: serve
    `GET /debug/engine` (integrity check and memory counters; off by default). shutdown_timeout_s: on SIGTERM,
    how long in-flight requests may run before they are aborted.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str = "hybridcache"
    max_request_bytes: int = 1 << 20
    enable_debug_endpoints: bool = False
    shutdown_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
