"""The model runner: owns the model, its kernel backend and its device pools, and runs one `ForwardBatch` at a
time, with the step's checkpoint copies around it: restores, then the forward, then saves, all on one
stream with no host synchronisation (one batched copy per pool group and kind)."""

from __future__ import annotations

import torch

from hybridcache.cache.plan import Phase, Pool
from hybridcache.forward_batch import DeviceCopyOp, ForwardBatch
from hybridcache.kernels.backend import get_backend
from hybridcache.kernels.copy.block_copy import copy_blocks, copy_slots
from hybridcache.state_spec import DevicePools


class ModelRunner:
    """Runs forwards on the device pools. The backend is chosen and the pools (from the model's state
    specs) are allocated once, at construction."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        kernel_block_size: int,
        num_slots: int,
        dtype: torch.dtype,
        state_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.device = device
        self.backend = get_backend(device)
        self.pages_per_block = block_size // kernel_block_size
        self.pools = DevicePools.allocate(
            model.state_specs(dtype, state_dtype),
            num_pages=num_blocks * self.pages_per_block,
            kernel_block_size=kernel_block_size,
            num_slots=num_slots,
            device=device,
            slot_specs=model.slot_specs(dtype),
        )

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the BEFORE_FORWARD copy ops, the forward, then the AFTER_FORWARD ones; returns fp32 logits
        [num_seqs, vocab] at each sequence's last token."""
        batch = self.backend.prepare(batch)
        for op in batch.copies:
            if op.kind.phase is Phase.BEFORE_FORWARD:
                self._copy(op)
        logits = self.model(batch, self.pools, self.backend)
        for op in batch.copies:
            if op.kind.phase is Phase.AFTER_FORWARD:
                self._copy(op)
        return logits

    @torch.inference_mode()
    def execute_copies(self, copies: tuple[DeviceCopyOp, ...]) -> None:
        """A step with no forward (only zero-prefill samples): its copy ops, BEFORE_FORWARD ones first."""
        for phase in (Phase.BEFORE_FORWARD, Phase.AFTER_FORWARD):
            for op in copies:
                if op.kind.phase is phase:
                    self._copy(op)

    def logits_from_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """fp32 logits [len(slots), vocab] from each slot's kept last hidden state, after the step's copies
        (a zero-prefill hit: the restored checkpoint's hidden state; no layer runs)."""
        return self.model.logits_from_slots(self.pools, slots)

    def _copy(self, op: DeviceCopyOp) -> None:
        """One batched copy per pool group: every attention layer's pages of each block (KV), or every
        recurrent state tensor's rows of each slot (STATE)."""
        if op.kind.pool is Pool.KV:
            for kv in self.pools.kv_groups:
                copy_blocks(kv, op.src_ids, op.dst_ids, pages_per_block=self.pages_per_block, page_dim=2)
        else:
            for state in self.pools.state_groups:
                copy_slots(state, op.src_ids, op.dst_ids)
