"""Log lines that outside traffic cannot multiply: a filter that passes at most `burst` warnings of one kind per
`interval_s`, then one line saying how many were dropped.

A flood (ten thousand half-open connections, "Too many open files" from the accept loop, a client retrying a
refused request) otherwise writes one line per event: megabytes a minute. A kind is the logger plus the
message's format string (not its arguments), so "closed a connection ..." lines are one kind whatever the
numbers they carry. Records below WARNING pass untouched (the access log and the stats line are their own
business).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitFilter(logging.Filter):
    """Passes at most `burst` records of one kind (logger, format string) per `interval_s` window; the first
    record of a later window carries the count of those dropped in between. `clock`: seconds (monotonic)."""

    def __init__(self, interval_s: float = 10.0, burst: int = 5, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.burst = burst
        self._clock = clock
        self._windows: dict[tuple[str, str], list[float | int]] = {}  # kind -> [window start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        kind = (record.name, str(record.msg))
        now = self._clock()
        window = self._windows.get(kind)
        if window is None or now - window[0] >= self.interval_s:
            dropped = window[2] if window is not None else 0
            self._windows[kind] = [now, 1, 0]
            if len(self._windows) > 1000:  # many kinds: forget the stale ones
                self._windows = {k: w for k, w in self._windows.items() if now - w[0] < self.interval_s}
            if dropped:
                record.msg = f"{record.msg} ({dropped} more like this in the last {self.interval_s:g} s not logged)"
            return True
        if window[1] < self.burst:
            window[1] += 1
            return True
        window[2] += 1
        return False


def install(logger_names: tuple[str, ...] = ("", "uvicorn"), **options: float) -> RateLimitFilter:
    """Add one `RateLimitFilter` to every handler of these loggers ("" is the root logger; uvicorn's own
    loggers do not propagate to it) and return it."""
    limiter = RateLimitFilter(**options)
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(limiter)
    return limiter
