"""Mamba1 kernels: the selective scan with its carried state [I, N] (one decay per channel and state entry).

`reference.py`: `selective_scan` (one sequence), `selective_step` (one token of M sequences),
`selective_states_after` (one sequence, every state kept), in torch. `triton.py`: the CUDA scan over a whole varlen
batch in one launch (`selective_scan_varlen`). The short convolution before the scan is the shared `kernels/conv`;
the dt discretization is Mamba2's (`mamba2.reference.discretized_dt`, without a limit)."""
