"""The driver's liveness monitor: a thread that watches the worker processes and aborts the process group the
moment one of them dies.

Why: on NCCL a collective is a kernel that spins until every rank has joined it; a rank that dies mid-step
leaves the driver blocked in a device synchronisation until NCCL's watchdog times out (300 s,
`COLLECTIVE_TIMEOUT`) and tears the process down. Aborting the group (`ProcessGroup.abort()`, i.e.
`ncclCommAbort`, from another thread) makes the spinning kernels exit and every later collective of the group
raise, so the blocked driver wakes within milliseconds and the executor names the dead rank. gloo needs no
abort (its sockets close with the dead peer and its collectives raise at once; `abort()` does nothing there)::

    monitor thread: wait(worker sentinels + stop pipe)  --rank 1 exits-->  dead_rank = 1; abort the group
    driver thread:  step ... stream.synchronize() (blocked) ------------>  returns; executor sees rank 1 dead

One death is enough: after it the monitor aborts once and ends (the executor is broken for good).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
from collections.abc import Callable, Mapping
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

_STOP_JOIN_S = 10.0  # an abort in progress is waited for this long at stop (NCCL bounds it by its own timeout)


class LivenessMonitor:
    """Watches `processes` (rank -> process) from a daemon thread; the first to exit sets `dead_rank` and
    `abort()` runs. `abort()` may also be called by the owner (on any failure); the abort function runs at most
    once either way, and exceptions it raises are kept in `abort_error`, never raised in the thread."""

    def __init__(self, processes: Mapping[int, BaseProcess], abort_group: Callable[[], None]) -> None:
        self._processes = dict(processes)
        self._abort_group = abort_group
        self._lock = threading.Lock()
        self._stop_reader, self._stop_writer = multiprocessing.Pipe(duplex=False)
        self.dead_rank: int | None = None
        self.aborted = False
        self.abort_error: BaseException | None = None
        self._thread = threading.Thread(target=self._watch, name="hybridcache-tp-monitor", daemon=True)
        self._thread.start()

    def abort(self) -> None:
        """Abort the group (once: the first caller runs the abort function, later calls return at once, also while
        it is still running). The abort may block until the rank's CUDA graphs are destroyed (NCCL's teardown
        waits for every graph that captured its collectives), which the owner does at shutdown: a second caller
        waiting for it here would deadlock."""
        with self._lock:
            if self.aborted:
                return
            self.aborted = True
        try:
            self._abort_group()
        except Exception as error:  # noqa: BLE001 (a failed abort must not kill the thread or the caller)
            self.abort_error = error

    def stop(self) -> None:
        """End the thread (idempotent); called before the workers are stopped, so their exit is not a death."""
        with contextlib.suppress(OSError):
            self._stop_writer.send_bytes(b"stop")
        if self._thread is not threading.current_thread():
            self._thread.join(_STOP_JOIN_S)
        self._stop_writer.close()

    def _watch(self) -> None:
        by_sentinel = {process.sentinel: rank for rank, process in self._processes.items()}
        ready = wait([self._stop_reader, *by_sentinel])
        if self._stop_reader in ready:
            return
        self.dead_rank = min(by_sentinel[sentinel] for sentinel in ready)
        self.abort()
