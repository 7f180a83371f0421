"""uvicorn's server with a clean exit status on SIGINT/SIGTERM (imported only by `serve`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import uvicorn


class Server(uvicorn.Server):
    """uvicorn's server, except that SIGINT/SIGTERM end it with exit status 0 (uvicorn re-raises the signal
    after its graceful shutdown, so the process would report death by signal)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
