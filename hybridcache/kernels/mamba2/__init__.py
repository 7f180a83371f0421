"""Mamba2 kernels: the selective state space scan (SSD) with its carried state [H, P, N] and the gated group RMSNorm.

`reference.py`: `ssd_chunk_scan` (one sequence, chunked SSD form), `ssd_step` (one token of N sequences),
`ssd_states_after` (one sequence, every state kept), `gated_group_rms_norm` (torch; on CUDA `norm/triton.py`'s
launch). `fla.py`: the CUDA scan (flash-linear-attention's chunked simple-GLA kernels for prefill rows; decode rows
through `triton_step.py`, one launch updating the state rows in place). The short convolution before the scan is the
shared `kernels/conv`."""
