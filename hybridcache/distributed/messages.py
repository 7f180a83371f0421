"""What the driver and the workers say to each other over their pipes, and how a step travels.

Driver -> worker, one message per step (every worker gets the same one)::

    (Op.EXECUTE, (ForwardBatch, fed))  restores, forward, saves (`ModelRunner.execute`); the logits are
                                  all-gathered. `fed`: None, or (rows, sources, n) of a `TokenFeed` (async
                                  scheduling): the n sampled tokens follow as a broadcast from rank 0 on the
                                  device (`fed_tokens`), never through the pipe
    (Op.COPIES, (DeviceCopyOp,))  a step with no forward (`ModelRunner.execute_copies`)
    (Op.LOGITS, slots)            `ModelRunner.logits_from_slots` (all-gathered)
    (Op.DRAFT, DraftPlan)         the MTP head's work after a step (`ModelRunner.draft`); the drafts a further
                                  head step embeds follow as broadcasts from rank 0 on the device
    (Op.BUDGET, bytes)            at start-up on CUDA: the budget every rank plans its pools with
    (Op.MODE, DecodeMode)         how later decode steps run (CUDA graphs: replay, without replay, eager)
    (Op.STOP, None)               leave the group and exit

Worker -> driver: (Op.STARTED, None) before joining the group, (Op.BUDGET, bytes) its own CUDA budget,
(Op.READY, None) once its pools are allocated, (Op.ERROR, traceback text) before it exits on an exception.

Tensors travel as numpy arrays (`HostTensor`), pickled with the message: a decode step of 64 sequences is
about 20 KiB.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from hybridcache.distributed.process_group import broadcast_from_driver
from hybridcache.engine.mtp_draft import DraftPlan, DraftStep
from hybridcache.engine.token_feed import TokenFeed
from hybridcache.forward_batch import DeviceCopyOp, ForwardBatch


class Op(Enum):
    STARTED = "started"
    BUDGET = "budget"
    READY = "ready"
    ERROR = "error"
    EXECUTE = "execute"
    COPIES = "copies"
    LOGITS = "logits"
    DRAFT = "draft"
    MODE = "mode"
    STOP = "stop"


class DecodeMode(Enum):
    """How a rank's decode-only steps run when its runner captured CUDA graphs (`ModelRunner`): every rank must
    run the same way, since a graph replays the collectives it captured."""

    REPLAY = "replay"  # the default: replay the bucket's graph
    WITHOUT_REPLAY = "without_replay"  # the graph's padded static batch, run eagerly (`ModelRunner.without_replay`)
    EAGER = "eager"  # the plain eager path (`ModelRunner.eager`)


@dataclass(frozen=True)
class HostTensor:
    """A tensor in transit: its values as a numpy array (which pickles as raw bytes, unlike a torch tensor),
    reinterpreted bit for bit when numpy lacks the dtype (bfloat16 travels as int16)."""

    array: np.ndarray
    dtype: torch.dtype

    @classmethod
    def pack(cls, tensor: torch.Tensor) -> HostTensor:
        host = tensor.detach().cpu()
        if host.dtype == torch.bfloat16:
            host = host.view(torch.int16)
        return cls(host.numpy(), tensor.dtype)

    def unpack(self, device: torch.device | str) -> torch.Tensor:
        """The tensor on `device`; on CUDA through pinned memory, non-blocking, so a worker's host does not wait
        for the steps its device still runs (a copy from pageable memory may) and queues the next one meanwhile."""
        tensor = torch.from_numpy(self.array)
        if tensor.dtype != self.dtype:
            tensor = tensor.view(self.dtype)
        if torch.device(device).type == "cuda":
            return tensor.pin_memory().to(device, non_blocking=True)
        return tensor.to(device)


def map_tensors(value: Any, fn: Callable[[Any], Any], kind: type = torch.Tensor) -> Any:
    """`value` with `fn` applied to every `kind` inside it: a tuple, a `DeviceCopyOp`, a `ForwardBatch` (not
    yet prepared: backend metadata does not travel) or a `DraftPlan` / `DraftStep`; other values unchanged."""
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn, kind) for v in value)
    if isinstance(value, DeviceCopyOp):
        return dataclasses.replace(value, src_ids=fn(value.src_ids), dst_ids=fn(value.dst_ids))
    if isinstance(value, (DraftPlan, DraftStep)):
        return dataclasses.replace(value, **{
            f.name: map_tensors(getattr(value, f.name), fn, kind) for f in dataclasses.fields(value)
        })
    if isinstance(value, ForwardBatch):
        if value.metadata is not None:
            raise ValueError("a prepared ForwardBatch cannot be sent to another rank")
        return dataclasses.replace(value, **{
            f.name: map_tensors(getattr(value, f.name), fn, kind) for f in dataclasses.fields(value)
            if f.name not in ("metadata", "query_lens_cpu", "context_lens_cpu")
        })
    return value


FedRows = tuple[tuple[int, ...], tuple[int, ...], int]  # a TokenFeed's rows, sources and token count


def fed_rows(feed: TokenFeed | None) -> FedRows | None:
    """What an EXECUTE message says of the step's `TokenFeed` (its tokens travel by broadcast)."""
    return None if feed is None else (feed.rows, feed.sources, feed.tokens.shape[0])


def fed_tokens(fed: FedRows | None, device: torch.device) -> TokenFeed | None:
    """A worker's `TokenFeed` for an EXECUTE message's `fed`: its tokens received from rank 0's broadcast."""
    if fed is None:
        return None
    rows, sources, count = fed
    tokens = broadcast_from_driver(torch.empty(count, dtype=torch.int64, device=device))
    return TokenFeed(rows, sources, tokens)


def send(conn: Connection, op: Op, payload: Any = None) -> None:
    conn.send_bytes(encode(op, payload))


def encode(op: Op, payload: Any = None) -> bytes:
    """One message's bytes (to send the same step to every worker, pickled once); tensors as `HostTensor`s."""
    return pickle.dumps((op, map_tensors(payload, HostTensor.pack)), protocol=pickle.HIGHEST_PROTOCOL)


def receive(conn: Connection, device: torch.device | str = "cpu") -> tuple[Op, Any]:
    """The next message, its tensors on `device`."""
    op, payload = pickle.loads(conn.recv_bytes())
    return op, map_tensors(payload, lambda host: host.unpack(device), HostTensor)
