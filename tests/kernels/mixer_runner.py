"""Feeds one recurrent mixer (Mamba2's, Mamba1's, OLMo Hybrid's DeltaNet, LFM2's short conv: anything with
`state_spec` and `forward(hidden, step, state)`) varlen steps the way the engine does, for the mixer-vs-transformers
tests (test_mamba2_mixer.py, test_mamba1_mixer.py, test_olmo_deltanet_mixer.py, test_short_conv_mixer.py)."""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.kernels.backend import KernelBackend, ReferenceBackend
from hybridcache.layers.step import StepContext
from hybridcache.state_spec import DevicePools


class MixerRunner:
    """Each sequence its own state slot (garbage at first: a fresh sequence must not read its row); `backend`:
    the kernels the mixer calls (default the reference)."""

    def __init__(self, mixer: nn.Module, num_seqs: int, backend: KernelBackend | None = None) -> None:
        self.mixer = mixer
        self.backend = backend if backend is not None else ReferenceBackend()
        self.pools = DevicePools.allocate([mixer.state_spec(torch.float32, torch.float32)], num_pages=1,
                                          kernel_block_size=16, num_slots=num_seqs + 2)
        generator = torch.Generator().manual_seed(7)
        for pool in self.pools.state_groups:
            pool.copy_(torch.randn(pool.shape, generator=generator))
        self.fed = [0] * num_seqs

    def step(self, feeds: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        """(seq, hidden [n, hidden]) pairs in one step -> each feed's output [n, hidden]."""
        chunks = []
        for seq, hidden in feeds:
            chunks.append(SeqChunk([0] * hidden.shape[0], self.fed[seq], [0] * 64, seq + 1))
            self.fed[seq] += hidden.shape[0]
        batch = self.backend.prepare(build_forward_batch(chunks, block_size=16, kernel_block_size=16))
        step = StepContext(batch=batch, backend=self.backend, rope=(torch.empty(0), torch.empty(0)))
        with torch.inference_mode():
            out = self.mixer(torch.cat([hidden for _, hidden in feeds]), step, self.pools.layers[0])
        bounds = batch.cu_seqlens.tolist()
        return [out[bounds[i] : bounds[i + 1]] for i in range(len(feeds))]
