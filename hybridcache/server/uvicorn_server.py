"""uvicorn's server with a clean exit status on SIGINT/SIGTERM, and whose shutdown lets the requests it cancelled
send their last bytes; and its listening socket, bound before the model loads (imported only by `serve` and the
router)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import stat
import threading
from collections.abc import Callable, Iterator

import uvicorn

FLUSH_S = 0.25  # the most the shutdown waits, after uvicorn's, for cancelled requests' last bytes to leave
LISTEN_FD_ENV = "HYBRIDCACHE_LISTEN_FD"  # a data-parallel replica's socket, bound by its parent


class Server(uvicorn.Server):
    """uvicorn's server, except that SIGINT/SIGTERM end it with exit status 0 (uvicorn re-raises the signal
    after its graceful shutdown, so the process would report death by signal), and that its shutdown waits up to
    `FLUSH_S` for the requests cancelled at the end of the grace period to finish and for every connection's
    write buffer to empty: uvicorn returns right after cancelling them, and the process then exits at once
    (`server.cli._exit_now`), which cut a stream's final error event and `[DONE]` mid-line on a busy machine.
    `on_shutdown`, when given, is called as the shutdown begins (the data-parallel router sends its replicas SIGTERM
    there, so that their grace periods run alongside its own)."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.on_shutdown = on_shutdown

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's; on sockets bound before (`listen_socket`), a failure to listen (another server that bound the
        same port at the same time listened first: `SO_REUSEADDR` lets both bind) shuts the application down and
        raises `cannot listen on ADDRESS: ...`, as a busy port found at the bind."""
        try:
            await super().startup(sockets)
        except OSError as error:
            if sockets is None:
                raise
            await self.lifespan.shutdown()
            address = sockets[0].getsockname()
            name = address if isinstance(address, str) else f"{address[0]}:{address[1]}"
            raise OSError(f"cannot listen on {name}: {error.strerror or error}") from error
        if sockets is not None and self.started:  # uvicorn logs where it listens only on sockets it bound itself
            self._log_started_message(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown()
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


def listen_socket(host: str, port: int, uds: str | None = None) -> socket.socket:
    """The server's socket, bound to `host`:`port` (IPv6 when `host` has a colon), or to the Unix socket path `uds`,
    for `Server.run(sockets=[...])`: bound first, so that a busy port or a host that cannot be bound is an
    OSError (`cannot listen on HOST:PORT: ...`) before the model loads, as vLLM binds before it builds the engine.
    Not listening yet: uvicorn listens once the application has started."""
    if uds is not None:
        sock, address, name = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), uds, f"unix socket {uds}"
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        address, name = (host, port), f"{host}:{port}"
    try:
        sock.bind(address)
        if uds is not None:
            os.chmod(uds, 0o666)  # as uvicorn's --uds
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {name}: {error.strerror or error}") from error
    return sock


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread while the block runs (as vLLM's setup_server, "interrupt
    server on sigterm while initializing"), before uvicorn's own handler: `serve` loading its model, and
    `serve --data-parallel-size` starting its replicas (the default handler ended that process at once, without the
    `finally` that ends them). As PID 1 of a container (no init), a signal left at its default action is ignored:
    a SIGTERM while the model loaded did nothing, the server started, and only the SIGKILL at the end of the grace
    period ended it."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def inherited_socket() -> socket.socket | None:
    """The socket `serve --data-parallel-size`'s parent bound for this replica and passed as the file descriptor
    named by $HYBRIDCACHE_LISTEN_FD (`router.cli.serve_data_parallel`), or None when there is none. The parent
    binding each replica's port means a replica cannot lose its port to another server and be replaced by it."""
    fd = os.environ.pop(LISTEN_FD_ENV, None)
    return None if fd is None else socket.socket(fileno=int(fd))


def remove_stale_socket(path: str) -> None:
    """Remove the Unix socket at `path` if no server listens on it (one left by a server that ended without
    removing it); a file of another kind is left for `listen_socket` to refuse. A socket a live server listens on
    is an OSError (`cannot listen on unix socket PATH: ...`), as vLLM refuses it: taking it over would cut that
    server off from its clients."""
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return
    except OSError:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:  # nobody listens (ECONNREFUSED): stale
            with contextlib.suppress(OSError):
                os.remove(path)
            return
    raise OSError(f"cannot listen on unix socket {path}: a server is listening on it")


def _buffered(connection: object) -> int:
    """Bytes a connection's transport still holds to send (a closing transport still sends them; 0 without one)."""
    transport = getattr(connection, "transport", None)
    return 0 if transport is None else transport.get_write_buffer_size()
