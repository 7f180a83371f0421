"""The model runner: owns the model and its device pools, and runs one `ForwardBatch` at a time, with the
step's checkpoint copies around it: restores, then the forward, then saves, all on one stream with no host
synchronisation (one batched copy per pool and kind)."""

from __future__ import annotations

import torch

from hybridcache.cache.plan import Phase, Pool
from hybridcache.forward_batch import DeviceCopyOp, DevicePools, ForwardBatch
from hybridcache.kernels.block_copy import copy_blocks, copy_slots


class ModelRunner:
    """Runs forwards on the device pools. The pools are allocated once, at construction."""

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
        self.pages_per_block = block_size // kernel_block_size
        self.pools = DevicePools.allocate(
            model.layer_shapes(),
            num_pages=num_blocks * (block_size // kernel_block_size),
            kernel_block_size=kernel_block_size,
            num_slots=num_slots,
            dtype=dtype,
            state_dtype=state_dtype,
            device=device,
        )

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the BEFORE_FORWARD copy ops, the forward, then the AFTER_FORWARD ones; returns fp32 logits
        [num_seqs, vocab] at each sequence's last token."""
        for op in batch.copies:
            if op.kind.phase is Phase.BEFORE_FORWARD:
                self._copy(op)
        logits = self.model(batch, self.pools)
        for op in batch.copies:
            if op.kind.phase is Phase.AFTER_FORWARD:
                self._copy(op)
        return logits

    def _copy(self, op: DeviceCopyOp) -> None:
        """One batched copy per pool tensor."""
        if op.kind.pool is Pool.KV:
            copy_blocks(self.pools.kv, op.src_ids, op.dst_ids, pages_per_block=self.pages_per_block, page_dim=2)
        else:
            copy_slots(self.pools.conv, op.src_ids, op.dst_ids)
            copy_slots(self.pools.ssm, op.src_ids, op.dst_ids)
