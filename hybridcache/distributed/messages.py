"""What the driver and the workers say to each other over their pipes, and how a step travels.

Driver -> worker, one message per step (every worker gets the same one)::

    (Op.EXECUTE, ForwardBatch)    restores, forward, saves (`ModelRunner.execute`); the logits are all-gathered
    (Op.COPIES, (DeviceCopyOp,))  a step with no forward (`ModelRunner.execute_copies`)
    (Op.LOGITS, slots)            `ModelRunner.logits_from_slots` (all-gathered)
    (Op.BUDGET, bytes)            at start-up on CUDA: the budget every rank plans its pools with
    (Op.STOP, None)               leave the group and exit

Worker -> driver: (Op.STARTED, None) before joining the group, (Op.BUDGET, bytes) its own CUDA budget,
(Op.READY, None) once its pools are allocated, (Op.ERROR, traceback text) before it exits on an exception.

Tensors travel on the CPU (`to_device`), pickled with the message: the step's ids are a few KiB.
"""

from __future__ import annotations

import dataclasses
import pickle
from enum import Enum
from multiprocessing.connection import Connection
from typing import Any

import torch

from hybridcache.forward_batch import DeviceCopyOp, ForwardBatch


class Op(Enum):
    STARTED = "started"
    BUDGET = "budget"
    READY = "ready"
    ERROR = "error"
    EXECUTE = "execute"
    COPIES = "copies"
    LOGITS = "logits"
    STOP = "stop"


def to_device(value: Any, device: torch.device | str) -> Any:
    """A tensor, a `DeviceCopyOp`, a tuple of them or a `ForwardBatch` with every tensor on `device` (other
    values unchanged). A batch must not be prepared yet (its backend metadata does not travel)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(to_device(v, device) for v in value)
    if isinstance(value, DeviceCopyOp):
        return dataclasses.replace(value, src_ids=value.src_ids.to(device), dst_ids=value.dst_ids.to(device))
    if isinstance(value, ForwardBatch):
        if value.metadata is not None:
            raise ValueError("a prepared ForwardBatch cannot be sent to another rank")
        fields = {f.name: to_device(getattr(value, f.name), device) for f in dataclasses.fields(value)
                  if f.name != "metadata"}
        return ForwardBatch(**fields)
    return value


def send(conn: Connection, op: Op, payload: Any = None) -> None:
    conn.send_bytes(encode(op, payload))


def encode(op: Op, payload: Any = None) -> bytes:
    """One message's bytes (to send the same step to every worker, pickled once)."""
    return pickle.dumps((op, to_device(payload, "cpu")), protocol=pickle.HIGHEST_PROTOCOL)


def receive(conn: Connection) -> tuple[Op, Any]:
    op, payload = pickle.loads(conn.recv_bytes())
    return op, payload
