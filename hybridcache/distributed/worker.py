"""A worker process: rank r >= 1 of the tensor-parallel group (rank 0 is the driver, in the engine's process).

It joins the group, builds its runner exactly as the driver builds rank 0's (`build_runner`, same spec), then
runs whatever step the driver sends, in order (decode steps replay the CUDA graphs it captured, like every
rank's, unless a `DecodeMode` message says otherwise; a step's fed tokens arrive by broadcast from rank 0, see
`messages.fed_tokens`), until told to stop or until the driver is gone (its pipe closes). Its graphs are destroyed
before it leaves the group (NCCL's teardown waits for them). An exception is sent to the driver as text before the
worker exits; the driver names the rank.
SIGINT is ignored (a Ctrl-C in the terminal reaches the whole process group: the driver decides).

A thread watches the driver: when the worker's parent process is gone (its parent pid changes), the worker
exits at once, even while its main thread waits in an NCCL collective that the dead driver will never join
(gloo's collectives fail by themselves when the driver's sockets close; NCCL's spin until the watchdog).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from hybridcache.distributed.messages import DecodeMode, Op, fed_tokens, receive, send
from hybridcache.distributed.process_group import broadcast_from_driver, init_group, leave_group, rank_device
from hybridcache.engine.rank_runner import RunnerSpec, build_runner
from hybridcache.engine.runner import ModelRunner
from hybridcache.layers.parallel import TensorParallel

DRIVER_POLL_S = 0.2


def worker_main(spec: RunnerSpec, rank: int, size: int, store_dir: Path, conn: Connection) -> None:
    """The process's entry point (spawned by `TensorParallelExecutor`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    try:
        _serve(spec, rank, size, store_dir, conn)
    except (EOFError, BrokenPipeError):  # the driver is gone: nothing to report to, the group is broken
        leave_group(aborted=True)
        sys.exit(1)
    except BaseException:  # noqa: BLE001 (every failure is reported, then the worker exits)
        with contextlib.suppress(OSError):
            send(conn, Op.ERROR, traceback.format_exc())
        leave_group()
        sys.exit(1)
    leave_group()


def exit_with_parent() -> threading.Thread:
    """Start a daemon thread that ends this process (exit status 1, no cleanup: the group may be stuck) within
    `DRIVER_POLL_S` of the death of the process that spawned it (also when that happened before this call)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        raise RuntimeError("exit_with_parent runs in a process started by multiprocessing")
    parent_pid = parent.pid

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(DRIVER_POLL_S)
        os._exit(1)

    thread = threading.Thread(target=watch, name="hybridcache-tp-driver-watch", daemon=True)
    thread.start()
    return thread


def _serve(spec: RunnerSpec, rank: int, size: int, store_dir: Path, conn: Connection) -> None:
    device = rank_device(torch.device(spec.config.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # a device problem shows here, before the driver waits to meet us
    send(conn, Op.STARTED)
    init_group(store_dir, rank, size, device)

    def agree(budget: int) -> int:
        send(conn, Op.BUDGET, budget)
        op, agreed = receive(conn)
        if op is not Op.BUDGET:
            raise RuntimeError(f"expected the agreed memory budget, got {op}")
        return agreed

    runner, _ = build_runner(spec, TensorParallel(rank, size), device, agree)
    try:
        send(conn, Op.READY)
        _loop(runner, conn, device)
    finally:  # before `worker_main` leaves the group: NCCL's teardown waits for every graph holding its collectives
        runner.release_graphs()


def _loop(runner: ModelRunner, conn: Connection, device: torch.device) -> None:
    """Run the driver's steps until it says STOP."""
    with contextlib.ExitStack() as mode:  # holds the runner's context of the current DecodeMode
        while True:
            op, payload = receive(conn, device)
            if op is Op.STOP:
                return
            if op is Op.EXECUTE:
                batch, fed = payload
                runner.execute(batch, fed_tokens(fed, device))
            elif op is Op.COPIES:
                runner.execute_copies(payload)
            elif op is Op.LOGITS:
                runner.logits_from_slots(payload)
            elif op is Op.DRAFT:
                runner.draft(payload, broadcast_from_driver)
            elif op is Op.MODE:
                mode.close()
                if payload is not DecodeMode.REPLAY:
                    mode.enter_context(runner.eager() if payload is DecodeMode.EAGER else runner.without_replay())
            else:
                raise RuntimeError(f"unexpected message {op}")
