"""The model runner: owns the model and its device pools, and runs one `ForwardBatch` at a time."""

from __future__ import annotations

import torch

from hybridcache.forward_batch import DevicePools, ForwardBatch


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
        """Run the forward; returns fp32 logits [num_seqs, vocab] at each sequence's last token."""
        return self.model(batch, self.pools)
