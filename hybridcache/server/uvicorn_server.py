"""uvicorn's server with a clean exit status on SIGINT/SIGTERM, and whose shutdown lets the requests it cancelled
send their last bytes (imported only by `serve`)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Iterator

import uvicorn

FLUSH_S = 0.25  # the most the shutdown waits, after uvicorn's, for cancelled requests' last bytes to leave


class Server(uvicorn.Server):
    """uvicorn's server, except that SIGINT/SIGTERM end it with exit status 0 (uvicorn re-raises the signal
    after its graceful shutdown, so the process would report death by signal), and that its shutdown waits up to
    `FLUSH_S` for the requests cancelled at the end of the grace period to finish and for every connection's
    write buffer to empty: uvicorn returns right after cancelling them, and the process then exits at once
    (`server.cli._exit_now`), which cut a stream's final error event and `[DONE]` mid-line on a busy machine."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FLUSH_S
        while loop.time() < deadline and (
                any(not task.done() for task in self.server_state.tasks)
                or any(_buffered(connection) for connection in self.server_state.connections)):
            await asyncio.sleep(0.01)

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


def _buffered(connection: object) -> int:
    """Bytes a connection's transport still holds to send (a closing transport still sends them; 0 without one)."""
    transport = getattr(connection, "transport", None)
    return 0 if transport is None else transport.get_write_buffer_size()
