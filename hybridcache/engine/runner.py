"""The model runner: owns the model and its device pools, and runs one `ForwardBatch` at a time, with the
step's checkpoint copies around it: restores, then the forward, then saves, all on one stream with no host
synchronisation (one batched copy per pool and kind)."""

from __future__ import annotations

import torch

from hybridcache.forward_batch import DevicePools, ForwardBatch, IdPairs
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
        """Run restores, the forward, then saves; returns fp32 logits [num_seqs, vocab] at each sequence's
        last token."""
        copies = batch.copies
        self._copy_kv(copies.kv_restore)
        self._copy_state(copies.state_restore)
        logits = self.model(batch, self.pools)
        self._copy_kv(copies.kv_save)
        self._copy_state(copies.state_save)
        return logits

    def _copy_kv(self, pairs: IdPairs | None) -> None:
        if pairs is not None:
            copy_blocks(self.pools.kv, pairs[0], pairs[1], pages_per_block=self.pages_per_block, page_dim=2)

    def _copy_state(self, pairs: IdPairs | None) -> None:
        if pairs is not None:
            copy_slots(self.pools.conv, pairs[0], pairs[1])
            copy_slots(self.pools.ssm, pairs[0], pairs[1])
