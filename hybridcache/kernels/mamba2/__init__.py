"""Mamba2 kernels: the selective state space scan (SSD) with its carried state [H, P, N] and the gated group RMSNorm.

`reference.py`: `ssd_chunk_scan` (one sequence, chunked SSD form), `ssd_step` (one token of N sequences),
`ssd_states_after` (one sequence, every state kept), `gated_group_rms_norm` (torch). `fla.py`: the CUDA scan
(flash-linear-attention's chunked simple-GLA kernels for prefill rows, the torch step for decode rows). The short
convolution before the scan is the shared `kernels/conv`."""
