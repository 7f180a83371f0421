"""The server's logging: its set-up (`configure_logging`), and log lines that outside traffic cannot multiply.

`RateLimitFilter` passes at most `burst` warnings of one kind per `interval_s`; once a window in which some were
dropped has ended, one line says how many and since when:

    t=0 s    warning #1 ... #5   logged
    t=0-9 s  warning #6 ... #97  dropped (the window's first drop starts a timer)
    t=10 s   "92 more warnings like 'closed connection %d' not logged since 09:53:10"   (the timer, or the
             next warning of the kind if it comes first; a process that exits before then loses it)

A flood (ten thousand half-open connections, "Too many open files" from the accept loop, a client retrying a
refused request) otherwise writes one line per event: megabytes a minute. A kind is the logger plus the
message's format string (not its arguments), so "closed a connection ..." lines are one kind whatever the
numbers they carry. Records below WARNING pass untouched (the access log and the stats line are their own
business).

`LoggedOnceFilter` drops uvicorn's "Exception in ASGI application" record for an error the app's 500 handler has
logged already (`mark_logged`): Starlette re-raises after the handler, so each failure was two tracebacks.

A data-parallel replica is told its index by `REPLICA_INDEX_ENV`; its log lines then carry `[replica N]` (uvicorn's
too: `tag_replica_lines`), and its stats lines start with `Engine 00N: `, as vLLM's, so the replicas' lines in one
stream can be told apart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

REPLICA_INDEX_ENV = "HYBRIDCACHE_REPLICA_INDEX"
_LOGGED_MARK = "_hybridcache_logged"

Schedule = Callable[[float, Callable[[], None]], None]


def replica_index(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's data-parallel replica index (`REPLICA_INDEX_ENV`), or None when it is no replica (the
    variable unset, empty or not a number)."""
    value = (os.environ if environ is None else environ).get(REPLICA_INDEX_ENV, "").strip()
    return int(value) if value.isdigit() else None


def log_format(replica: int | None) -> str:
    """The log line format: time, level, `[replica N]` for a data-parallel replica, logger, message."""
    tag = f"[replica {replica}] " if replica is not None else ""
    return f"%(asctime)s %(levelname)s {tag}%(name)s: %(message)s"


def configure_logging(level: str, environ: Mapping[str, str] | None = None) -> None:
    """The root logger at `level` (a name: "info", "debug", ...) with `log_format`; httpx's and httpcore's only from
    WARNING on (but at debug): they log every request at INFO, URL included, and an image URL may carry
    credentials or a signed query (`http://user:password@host/...?X-Amz-Signature=...`)."""
    logging.basicConfig(level=level.upper(), format=log_format(replica_index(environ)))
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.DEBUG if level.lower() == "debug" else logging.WARNING)


class _Tagged(logging.Formatter):
    """Another formatter's lines, each started with `tag`."""

    def __init__(self, inner: logging.Formatter, tag: str) -> None:
        super().__init__()
        self._inner, self._tag = inner, tag

    def format(self, record: logging.LogRecord) -> str:
        return self._tag + self._inner.format(record)


def tag_replica_lines(logger_names: tuple[str, ...] = ("uvicorn", "uvicorn.access"),
                      environ: Mapping[str, str] | None = None) -> None:
    """In a data-parallel replica, start the lines of these loggers' handlers (uvicorn's own, in its own format,
    set up by `uvicorn.Config`) with `[replica N] `, as `log_format` does the others'; elsewhere a no-op."""
    replica = replica_index(environ)
    if replica is None:
        return
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            if not isinstance(handler.formatter, _Tagged):
                handler.setFormatter(_Tagged(handler.formatter or logging.Formatter(), f"[replica {replica}] "))


def _start_timer(delay_s: float, callback: Callable[[], None]) -> None:
    timer = threading.Timer(delay_s, callback)
    timer.daemon = True
    timer.start()


@dataclass
class _Window:
    """One kind's current window: its start (monotonic, and the wall-clock time of its first record), the records
    passed and dropped in it, and the level, logger and format string of the kind."""

    start: float
    created: float
    name: str
    msg: str
    levelno: int
    passed: int = 1
    dropped: int = 0


class RateLimitFilter(logging.Filter):
    """Passes at most `burst` records of one kind (logger, format string) per `interval_s` window; a window with
    drops is reported by one record of its own once it has ended (`schedule(delay_s, callback)` runs the report:
    a daemon timer by default), or by the next record of its kind, whichever comes first. `clock`: seconds
    (monotonic). Thread-safe: records come from the event loop, the engine thread and the timers."""

    def __init__(self, interval_s: float = 10.0, burst: int = 5, clock: Callable[[], float] = time.monotonic,
                 schedule: Schedule = _start_timer) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.burst = burst
        self._clock = clock
        self._schedule = schedule
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, str], _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        kind = (record.name, str(record.msg))
        now = self._clock()
        ended = None
        with self._lock:
            window = self._windows.get(kind)
            if window is None or now - window.start >= self.interval_s:
                ended = window
                self._windows[kind] = _Window(now, record.created, record.name, str(record.msg), record.levelno)
                if len(self._windows) > 1000:  # many kinds: forget the stale ones (their timers keep their drops)
                    self._windows = {k: w for k, w in self._windows.items() if now - w.start < self.interval_s}
                passed = True
            elif window.passed < self.burst:
                window.passed += 1
                passed = True
            else:
                window.dropped += 1
                passed = False
                if window.dropped == 1:
                    self._schedule(max(0.0, window.start + self.interval_s - now), lambda: self._report(window))
        if ended is not None:
            self._report(ended)  # before this record: the timer has not run yet
        return passed

    def _report(self, window: _Window) -> None:
        with self._lock:
            dropped, window.dropped = window.dropped, 0
        if not dropped:
            return
        since = time.strftime("%H:%M:%S", time.localtime(window.created))
        logger = logging.getLogger(window.name)
        logger.handle(logger.makeRecord(window.name, window.levelno, __file__, 0,
                                        "%d more warnings like %r not logged since %s",
                                        (dropped, window.msg, since), None))


def mark_logged(error: BaseException) -> None:
    """Note that `error` has been logged with its traceback, so that `LoggedOnceFilter` drops a second record."""
    with contextlib.suppress(AttributeError):  # an exception type without a __dict__: logged twice, as before
        setattr(error, _LOGGED_MARK, True)


class LoggedOnceFilter(logging.Filter):
    """Drops a record whose exception was logged already (`mark_logged`): uvicorn's "Exception in ASGI
    application" for an error the app's 500 handler logged, with the request it failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (error is not None and getattr(error, _LOGGED_MARK, False))


def install(logger_names: tuple[str, ...] = ("", "uvicorn"), **options: float) -> RateLimitFilter:
    """Add one `RateLimitFilter` and a `LoggedOnceFilter` to every handler of these loggers ("" is the root
    logger; uvicorn's own loggers do not propagate to it) and return the first."""
    limiter = RateLimitFilter(**options)
    once = LoggedOnceFilter()
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(once)
            handler.addFilter(limiter)
    return limiter
