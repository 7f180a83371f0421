"""Connections that cannot hold the server: uvicorn's HTTP/1.1 protocol with a read deadline and a connection cap.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`), but a connection that sends half a
request header, or a body slower than it promised, is kept open forever; and its `limit_concurrency` answers
requests over the limit with 503 while it keeps accepting (and holding) connections, so idle sockets can take
every file descriptor. `guarded_protocol(cap, read_timeout_s)` returns the protocol class uvicorn is given
(`uvicorn.Config(http=...)`):

- a request's headers and body must arrive within `read_timeout_s` of its first byte (of the connection's
  opening, for the first request); then the connection is closed (a handler still reading the body sees a
  client disconnect);
- at most `cap` connections are open: a connection that would pass the cap closes the oldest connection that
  is not running a request (one still sending its request, or idle between requests; a client sending a
  request in one go is not among them for long), else it is closed itself. A connection whose request is
  running is never closed for room.

The connection-limit and timeout lines are logged at WARNING through `hybridcache.server.connections`; the
rate-limit filter of `log_limits.py` keeps a flood of them to a few lines.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("hybridcache.server.connections")


def guarded_protocol(cap: int, read_timeout_s: float) -> type[H11Protocol]:
    """A subclass of uvicorn's h11 protocol with the read deadline and the connection cap (module docstring).
    Every connection of one server shares the registry of connections not running a request."""
    if cap < 1 or not read_timeout_s > 0:
        raise ValueError(f"need cap >= 1 and read_timeout_s > 0, got {cap} and {read_timeout_s}")
    # oldest first: connections not running a request (within their read deadline, or idle between requests)
    spare: dict[GuardedH11Protocol, None] = {}

    class GuardedH11Protocol(H11Protocol):
        _read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > cap:
                victim = next(iter(spare), None)
                if victim is None:
                    logger.warning("%d connections are open, the limit (--limit-concurrency); every one is "
                                   "running a request: a new connection was closed", len(self.connections) - 1)
                    self._stop_reading()
                    transport.close()
                    return
                logger.warning("%d connections are open, the limit (--limit-concurrency): closed the oldest one "
                               "not running a request", len(self.connections) - 1)
                victim._drop()
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._update()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._update()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_reading()
            super().connection_lost(exc)

        # ---------------------------------------------------------------------------------------- deadline
        def _update(self) -> None:
            """Arm the deadline while a request is being received, drop it once the request is read (or while
            the connection idles between requests: uvicorn's keep-alive timeout covers that); keep `spare` up to
            date."""
            if self.transport.is_closing():
                self._stop_reading()
                return
            receiving = self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
            idle = self.timeout_keep_alive_task is not None
            if receiving and not idle:
                self._arm()
            else:
                self._stop_reading()
                if idle:
                    spare[self] = None

        def _arm(self) -> None:
            if self._read_timer is None:  # a deadline is never pushed back by more bytes
                self._read_timer = self.loop.call_later(read_timeout_s, self._expired)
                spare.pop(self, None)  # (re)joins at the end: the order is that of becoming spare
                spare[self] = None

        def _stop_reading(self) -> None:
            """Drop the read deadline and leave `spare` (the request is read, or the connection is gone)."""
            spare.pop(self, None)
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _expired(self) -> None:
            self._read_timer = None
            logger.warning("closed a connection that did not send its request within %g s (--request-read-timeout)",
                           read_timeout_s)
            self._drop()

        def _drop(self) -> None:
            self._stop_reading()
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


def uvicorn_options(cap: int, read_timeout_s: float, timeout_keep_alive_s: float) -> dict[str, Any]:
    """The `uvicorn.Config` keyword arguments that put these limits in place."""
    return {"http": guarded_protocol(cap, read_timeout_s), "timeout_keep_alive": timeout_keep_alive_s}
