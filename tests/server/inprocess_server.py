"""A real HTTP server (uvicorn + the app + an engine on the built-in model) on a thread of the test process, for
server options that have no command-line flag of their own (`ServerConfig.reasoning_parser`,
`default_chat_template_kwargs`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.generation_config import SamplingDefaults
from hybridcache.models.builtin import BUILTIN_NAME
from hybridcache.server.app import ServedModel, build_app
from hybridcache.server.config import ServerConfig
from hybridcache.server.engine_loop import EngineLoop
from hybridcache.server.metrics import ServerMetrics
from hybridcache.server.uvicorn_server import Server
from hybridcache.tokenizer import Tokenizer

from .server_process import free_port

ENGINE = EngineConfig(block_size=16, max_model_len=4096, num_blocks=2048)


@contextlib.contextmanager
def serving(engine_config: EngineConfig = ENGINE, chat_template: str | None = None,
            sampling_defaults: SamplingDefaults | None = None, model_path: str | None = None,
            **server_options) -> Iterator[str]:
    """Serve the built-in model (or the folder `model_path`, served under the built-in model's name) on a free
    loopback port; yields the base URL (`.../v1` is the API).
    `chat_template`: the server's chat template instead of the folder's (serve's `--chat-template`);
    `sampling_defaults`: as a generation_config.json would give them (none by default)."""
    config = ServerConfig(port=free_port(), served_model_name=BUILTIN_NAME, **server_options)
    engine = LLMEngine(model_path, engine_config)
    metrics = ServerMetrics(model_name=config.served_model_name, max_model_len=engine.max_model_len)
    loop = EngineLoop(engine, metrics, max_queued_requests=config.limits.max_queued_requests,
                      request_timeout_s=config.limits.request_timeout_s)
    metrics.watch_engine(lambda: loop.state)
    tokenizer = Tokenizer(engine.model_path)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    model = ServedModel(tokenizer=tokenizer, max_model_len=engine.max_model_len,
                        vocab_size=engine.model_config.vocab_size,
                        sampling_defaults=sampling_defaults or SamplingDefaults())
    server = Server(uvicorn.Config(build_app(loop, model, config, metrics), host=config.host, port=config.port,
                                   log_level="warning", access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{config.port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.05)
        yield base_url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
