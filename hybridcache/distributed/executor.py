"""The engine's runner under tensor parallelism: rank 0 in the engine's process, ranks 1..N-1 in workers.

`TensorParallelExecutor` implements the engine's `Executor` protocol (`hybridcache.engine.executor`: `execute`,
`execute_copies`, `logits_from_slots`, `check_results`, `memory_plan`, `shutdown`, ...), so the scheduler, the
prefix cache and sampling run once, in the engine, exactly as without tensor parallelism. The engine builds each
step's inputs on the CPU (`input_device`); each call sends the step (the `ForwardBatch` with its copy ops, as CPU
id tensors) to every worker, then moves it to rank 0's device and runs it on rank 0's own shard; every rank runs
the same restores, forward and saves on its own shard of the pools, and the logits come back whole to rank 0
(all-gathered)::

    engine.step -> executor.execute(batch, feed) -> pipe: (EXECUTE, (batch, feed's rows)) -> worker r
                   rank 0: broadcast(feed.tokens)  ~~ device ~~>  worker r: tokens; runner.execute(batch, feed)
                   rank 0: runner.execute(batch, feed)              (collectives pair up per layer)
                   <- full logits on rank 0

With async scheduling a step's decode rows take the tokens the step before sampled, which exist only on rank 0's
device: the `TokenFeed`'s tokens go to the workers as a broadcast queued on the device, the first collective of
the step, so no host waits for them (the pipe carries only which rows take which token).

Speculative decoding: a verify step is an ordinary step; its rollback copies travel as a step of copies, and the MTP
head's pass after it as one `DraftPlan` (`draft`), run by every rank on its shard of the head in lock step; each
draft a further head step embeds is decided by rank 0 and broadcast on the device, like the fed tokens.

Failures: a `LivenessMonitor` thread watches the workers and aborts the group the moment one dies (NCCL would
otherwise leave rank 0 waiting in the step's collectives until its 300 s watchdog; gloo fails them by itself).
Every worker's liveness is checked before each step and after rank 0 has queued it, and again by
`check_results`, which the engine calls once it has waited for a step's sampled tokens: on CUDA a step cut short
by an abort returns garbage, so once the monitor has aborted, `check_results` raises (even while the dead worker
is still being reaped) and the garbage never reaches a request. The executor itself never waits for the device,
so step t+1 can be queued while step t runs.
A failure (a collective that raises, a dead worker, an exception a worker reports) is attributed to the worker
that died or reported it, and the engine raises `WorkerError` naming its rank. The executor is then broken:
every later call raises, the group is aborted and the other workers are stopped. `shutdown()` (also run when
the executor is garbage-collected and at interpreter exit) destroys rank 0's CUDA graphs, waits for the steps
rank 0 still has queued (unless the group failed), stops the monitor, then the workers (a STOP message, then
terminate, then kill), while rank 0 leaves the group in a thread whose wait is bounded (`LEAVE_TIMEOUT_S`).
The graphs go first because NCCL's communicator teardown, destroy and abort alike, waits until every CUDA graph
that captured one of its collectives is destroyed: leaving with the graphs alive never returns. A worker whose
driver dies (SIGTERM, SIGKILL) sees its pipe close and exits.

CUDA graphs (with `RunnerSpec.tp_cuda_graphs`): every rank captures the same decode buckets at start-up
(`build_runner`) and, given the same step, picks the same bucket, so each decode step replays the same graph on
every rank and the NCCL collectives captured in them pair up. `without_replay()` and `eager()` switch every rank
at once (a `DecodeMode` message).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridcache.distributed.messages import DecodeMode, Op, encode, fed_rows, map_tensors, receive, send
from hybridcache.distributed.monitor import LivenessMonitor
from hybridcache.distributed.process_group import (
    abort_group,
    broadcast_from_driver,
    init_group,
    leave_group,
    rank_device,
)
from hybridcache.distributed.worker import worker_main
from hybridcache.engine.mtp_draft import DraftPlan
from hybridcache.engine.rank_runner import RunnerSpec, build_runner
from hybridcache.engine.runner import ModelRunner
from hybridcache.engine.token_feed import TokenFeed
from hybridcache.forward_batch import DeviceCopyOp, ForwardBatch
from hybridcache.layers.parallel import TensorParallel
from hybridcache.models.loader import check_split
from hybridcache.models.mtp import check_mtp_head

STARTUP_TIMEOUT_S = 300.0  # a worker's interpreter start and imports, before it joins the group
FAILURE_GRACE_S = 5.0  # after a failed collective, how long to wait for the worker at fault to show itself
_STOP_WAIT_S = 5.0
# a worker that dies before it answers at start-up (`_expect`) often re-ran its parent's script (spawn)
_START_HINT = ("its output above says why; a script that starts a tensor-parallel engine must do so under "
               "`if __name__ == '__main__':` (the workers are spawned and import the script)")
LEAVE_TIMEOUT_S = 30.0  # rank 0's leaving of the group at shutdown is waited for this long
_logger = logging.getLogger("hybridcache.distributed")


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or raised; the message names its rank."""


@dataclass
class _Worker:
    rank: int
    process: BaseProcess
    conn: Connection

    def describe(self) -> str:
        return f"tensor-parallel worker rank {self.rank} (pid {self.process.pid})"


class TensorParallelExecutor:
    """N ranks over `torch.distributed` (see the module docstring). `memory_plan`: the plan every rank's pools
    follow (the CUDA budget is the minimum over the ranks)."""

    def __init__(self, spec: RunnerSpec, device: torch.device, size: int) -> None:
        """Start ranks 1..size-1 and build rank 0 on `device` (CUDA: its index, or 0, is rank 0's device)."""
        if size < 2:
            raise ValueError(f"a tensor-parallel executor needs 2 or more ranks, got {size}")
        for rank in (0, size - 1):  # a model (or FP8 block grid) that cannot be split fails here, before any process
            check_split(spec.model_path, TensorParallel(rank, size), quantization=spec.config.quantization,
                        load_format=spec.config.load_format)
        if spec.config.speculative_config is not None:  # so does an MTP head, or a folder without one
            check_mtp_head(spec.model_path, TensorParallel(0, size), load_format=spec.config.load_format,
                           kv_fp8=spec.config.kv_fp8)
        last = rank_device(device, size - 1)
        if last.type == "cuda" and last.index >= torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {size} from {device} needs devices up to {last}; this machine "
                             f"has {torch.cuda.device_count()} CUDA devices")
        if dist.is_initialized():
            raise RuntimeError("this process already runs a tensor-parallel group (one per process): shut the "
                               "other engine's executor down first (engine.runner.shutdown())")
        self.size = size
        device = rank_device(device, 0)
        self._workers: list[_Worker] = []
        self._cpu_threads: int | None = None  # rank 0's intra-op threads before the group took its share
        self._failure: BaseException | None = None
        self._monitors: list[LivenessMonitor] = []  # one, once the group exists
        self._runners: list[ModelRunner] = []  # rank 0's, once built (its graphs go before the group does)
        store_dir = Path(tempfile.mkdtemp(prefix="hybridcache-tp-"))
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._monitors, self._runners, store_dir)
        context = multiprocessing.get_context("spawn")
        try:
            for rank in range(1, size):
                parent, child = context.Pipe()
                process = context.Process(target=worker_main, args=(spec, rank, size, store_dir, child),
                                          name=f"hybridcache-tp-rank{rank}", daemon=True)
                with _unimportable_main_hidden():
                    process.start()
                child.close()
                self._workers.append(_Worker(rank, process, parent))
            for worker in self._workers:
                expect_message(worker, Op.STARTED, timeout=STARTUP_TIMEOUT_S)
            self._cpu_threads = init_group(store_dir, 0, size, device)
            self._monitors.append(LivenessMonitor({w.rank: w.process for w in self._workers}, abort_group))
            self.runner, self.memory_plan = build_runner(spec, TensorParallel(0, size), device, self._agree)
            self._runners.append(self.runner)
            for worker in self._workers:
                expect_message(worker, Op.READY)
        except BaseException:
            for monitor in self._monitors:  # the group may have collectives pending that no worker will join
                monitor.abort()
            self.shutdown()
            raise

    @classmethod
    def from_spec(cls, spec: RunnerSpec, device: torch.device) -> TensorParallelExecutor:
        """The executor of `spec.config.tensor_parallel_size` ranks (the engine's "tensor_parallel" backend)."""
        return cls(spec, device, spec.config.tensor_parallel_size)

    # ------------------------------------------------------------------------------ the runner's methods
    @property
    def backend(self) -> Any:
        return self.runner.backend

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """The captured decode batch sizes (every rank's are rank 0's); () when steps run eagerly."""
        return self.runner.graph_batch_sizes

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """`ModelRunner.eager` on every rank."""
        with self._decode_mode(DecodeMode.EAGER, self.runner.eager):
            yield

    @contextlib.contextmanager
    def without_replay(self) -> Iterator[None]:
        """`ModelRunner.without_replay` on every rank."""
        with self._decode_mode(DecodeMode.WITHOUT_REPLAY, self.runner.without_replay):
            yield

    @property
    def num_host_blocks(self) -> int:
        """The host tier's blocks: every rank holds its shard of each (`build_runner`), the same count as rank 0."""
        return self.runner.num_host_blocks

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """The process ids of ranks 1..N-1."""
        return tuple(worker.process.pid for worker in self._workers)

    @property
    def input_device(self) -> torch.device:
        """The CPU: a step's inputs are sent to the workers from the host as they are (no device-to-host copy,
        which would wait for the steps still queued), and moved to each rank's device there."""
        return torch.device("cpu")

    def execute(self, batch: ForwardBatch, feed: TokenFeed | None = None) -> torch.Tensor:
        """`ModelRunner.execute` on every rank. `feed` (async scheduling): rank 0 broadcasts its tokens to the
        other ranks on the device, then every rank writes them into its own copy of the batch."""
        def local() -> torch.Tensor:
            if feed is not None:
                broadcast_from_driver(feed.tokens.to(torch.int64).contiguous())
            return self.runner.execute(self._on_device(batch), feed)

        return self._run(Op.EXECUTE, (batch, fed_rows(feed)), local)

    def execute_copies(self, copies: tuple[DeviceCopyOp, ...]) -> None:
        self._run(Op.COPIES, copies, lambda: self.runner.execute_copies(self._on_device(copies)))

    def logits_from_slots(self, slots: torch.Tensor) -> torch.Tensor:
        return self._run(Op.LOGITS, slots, lambda: self.runner.logits_from_slots(self._on_device(slots)))

    def draft(self, plan: DraftPlan) -> torch.Tensor:
        """`ModelRunner.draft` on every rank, in lock step (the head's collectives pair up as a forward's): rank 0
        decides each draft that a further head step embeds and broadcasts it on the device; its tokens return."""
        return self._run(Op.DRAFT, plan, lambda: self.runner.draft(self._on_device(plan), broadcast_from_driver))

    def draft_after_verify(self, batch: ForwardBatch, logits: torch.Tensor,
                           near_pages: torch.Tensor) -> torch.Tensor | None:
        """None: under tensor parallelism the drafts follow the verdicts (`draft`: rank 0 agrees each one)."""
        del batch, logits, near_pages

    def draft_slots(self, slot: int, num_drafts: int) -> tuple[int, ...]:
        """`ModelRunner.draft_slots` (every rank's pools have rank 0's layout)."""
        return self.runner.draft_slots(slot, num_drafts)

    def check_results(self) -> None:
        """Raise `WorkerError` if a worker failed or the monitor aborted the group: the steps in flight then may
        have computed garbage (on NCCL an abort makes rank 0's collectives return early). The caller has waited
        for the results it is about to use (the engine: a step's sampled tokens), so no device wait here: a
        step t+1 already queued keeps running (async scheduling)."""
        self._run(None, None, lambda: None)

    def shutdown(self) -> None:
        """Stop the workers and leave the group (idempotent). On the CPU the calling thread gets back the intra-op
        thread count it had before the group (torch's count is per thread under OpenMP: call this from the thread
        that built the engine)."""
        self._finalizer()
        if self._cpu_threads is not None:
            torch.set_num_threads(self._cpu_threads)
            self._cpu_threads = None

    # ------------------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def _decode_mode(self, mode: DecodeMode, local: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
        """Every rank runs decode steps in `mode` within the block (the workers are told before the next step)."""
        self._run(Op.MODE, mode, lambda: None)
        try:
            with local():
                yield
        finally:
            if self._failure is None:
                self._run(Op.MODE, DecodeMode.REPLAY, lambda: None)

    def _on_device(self, value: Any) -> Any:
        """A step's inputs (built on `input_device`) on rank 0's device: pinned and non-blocking on CUDA."""
        device = self.runner.device
        if device.type != "cuda":
            return value
        return map_tensors(value, lambda t: t.pin_memory().to(device, non_blocking=True) if t.device.type == "cpu"
                           else t.to(device))

    def _run(self, op: Op | None, payload: Any, local: Callable[[], Any]) -> Any:
        """Send the step to every worker (`op` None: nothing to send), run it on rank 0 without waiting for the
        device, then check the workers; any failure breaks the executor (see the module docstring). On CUDA a
        step cut short by the monitor's abort returns garbage: `check_results`, after the caller's wait for the
        results, raises then."""
        if self._failure is not None:
            raise WorkerError(f"the tensor-parallel group failed earlier: {self._failure}") from self._failure
        try:
            failure = self._find_failure(grace_s=0.0)
            if failure is not None:
                raise failure
            if op is not None:
                message = encode(op, payload)
                for worker in self._workers:
                    worker.conn.send_bytes(message)
            result = local()
            self._check_after_step()
            return result
        except BaseException as error:
            failure = error if isinstance(error, WorkerError) else self._find_failure(grace_s=FAILURE_GRACE_S)
            self._failure = failure or error
            self._monitors[0].abort()  # pending collectives may wait for a rank that will never join them
            for worker in self._workers:  # they may be waiting in a collective that will never complete
                if worker.process.is_alive():
                    worker.process.terminate()
            self.shutdown()
            if failure is None or failure is error:
                raise
            raise failure from error

    def _check_after_step(self) -> None:
        """Raise if a worker failed during the step. Once the monitor has aborted the group the step's results are
        garbage whatever the workers look like: a killed CUDA process closes its pipes (which wakes the monitor)
        some time before it is reaped (its device context is torn down in between), so `is_alive()` may still
        say True here; the dead worker is then waited for (`FAILURE_GRACE_S`) to name it and its exit."""
        monitor = self._monitors[0]
        failure = self._find_failure(grace_s=FAILURE_GRACE_S if monitor.aborted else 0.0)
        if failure is None and monitor.aborted:
            failure = WorkerError(f"the tensor-parallel group was aborted: worker rank {monitor.dead_rank} exited "
                                  f"and was not reaped within {FAILURE_GRACE_S:.0f} s")
        if failure is not None:
            raise failure

    def _find_failure(self, grace_s: float) -> WorkerError | None:
        """A `WorkerError` for the first worker that reported an exception or died, waiting up to `grace_s`
        for one to show; None when all are alive and silent."""
        deadline = time.monotonic() + grace_s
        while True:
            for worker in self._workers:
                if worker.conn.poll():
                    try:
                        op, payload = receive(worker.conn)
                    except (EOFError, OSError):
                        op, payload = None, None
                    if op is Op.ERROR:
                        return WorkerError(f"{worker.describe()} raised:\n{payload}")
                if not worker.process.is_alive():
                    return WorkerError(f"{worker.describe()} died ({_exit_reason(worker.process.exitcode)})")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _agree(self, budget: int) -> int:
        """The smallest CUDA budget over the ranks, sent to every worker (each waits for it)."""
        agreed = min([budget, *(expect_message(worker, Op.BUDGET) for worker in self._workers)])
        for worker in self._workers:
            send(worker.conn, Op.BUDGET, agreed)
        return agreed


def expect_message(worker: _Worker, op: Op, timeout: float | None = None) -> Any:
    """The payload of the worker's next message, which must be `op`; WorkerError if it dies, reports an
    exception or (with `timeout`) says nothing for `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    hint = f"; {_START_HINT}" if op is Op.STARTED else ""  # (later deaths have other causes: memory, a kernel)
    while not worker.conn.poll():
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise WorkerError(f"{worker.describe()} did not answer {op.value!r} within {timeout:.0f} s")
        wait([worker.conn, worker.process.sentinel], timeout=left)
        if not worker.conn.poll() and not worker.process.is_alive():
            raise WorkerError(f"{worker.describe()} died ({_exit_reason(worker.process.exitcode)}){hint}")
    try:
        got, payload = receive(worker.conn)
    except (EOFError, OSError):  # a closed pipe polls as readable: the worker died
        worker.process.join(1)
        raise WorkerError(f"{worker.describe()} died ({_exit_reason(worker.process.exitcode)}){hint}") from None
    if got is Op.ERROR:
        raise WorkerError(f"{worker.describe()} raised:\n{payload}")
    if got is not op:
        raise WorkerError(f"{worker.describe()} sent {got.value!r}, expected {op.value!r}")
    return payload


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


@contextlib.contextmanager
def _unimportable_main_hidden() -> Iterator[None]:
    """A spawned process first runs the parent's `__main__` again, from its `__file__`; a script read from stdin
    has `__file__ == '<stdin>'`, which the worker cannot open (FileNotFoundError). The workers need nothing of
    `__main__` (their target lives in `hybridcache.distributed.worker`), so such a file is hidden while they
    start. A `__main__` run as a module (`python -m`) or from a real file is left as it is."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(main, "__spec__", None) is not None or os.path.exists(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _shutdown(workers: list[_Worker], monitors: list[LivenessMonitor], runners: list[ModelRunner],
              store_dir: Path) -> None:
    """Destroy rank 0's CUDA graphs and wait for its queued steps, stop the monitor, then every worker (STOP: each
    destroys its graphs and leaves the group; then terminate, then kill) while rank 0 leaves the group (aborting it
    if it failed), remove the store.

    The graphs go first: NCCL's communicator teardown (`destroy_process_group`, and an abort too) waits until
    every CUDA graph that captured one of its collectives has been destroyed, so leaving the group while the
    runner still held its decode graphs never returned (pytorch/pytorch#115388); a monitor thread already
    aborting the group is blocked on the same graphs and returns once they are gone."""
    for runner in runners:
        runner.release_graphs()
        if runner.device.type == "cuda" and not any(monitor.aborted for monitor in monitors):
            # the steps still queued (async scheduling) finish their collectives while every rank is in the
            # group; a worker that dies meanwhile is caught by the monitor, still running, which aborts them
            torch.cuda.synchronize(runner.device)
    runners.clear()
    for monitor in monitors:
        monitor.stop()
    for worker in workers:
        with contextlib.suppress(OSError):
            send(worker.conn, Op.STOP)
    # rank 0 leaves while the workers do (a communicator's teardown may wait for its peers'), in a thread whose
    # wait is bounded: whatever NCCL does there, shutdown returns
    aborted = any(monitor.aborted for monitor in monitors)
    leaving = threading.Thread(target=leave_group, args=(aborted,), name="hybridcache-tp-leave", daemon=True)
    try:
        leaving.start()
    except RuntimeError:  # at interpreter exit (Python >= 3.12 starts no thread then): leave from here, after them
        leaving = None
    deadline = time.monotonic() + _STOP_WAIT_S
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
        if worker.process.is_alive():
            worker.process.terminate()
            worker.process.join(2.0)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.conn.close()
    if leaving is None:
        leave_group(aborted)
    else:
        leaving.join(LEAVE_TIMEOUT_S)
    if leaving is not None and leaving.is_alive():
        _logger.warning("rank 0 did not leave the tensor-parallel process group within %.0f s; left behind (a new "
                        "tensor-parallel engine cannot start in this process)", LEAVE_TIMEOUT_S)
    shutil.rmtree(store_dir, ignore_errors=True)
