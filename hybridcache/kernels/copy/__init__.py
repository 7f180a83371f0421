"""Batched copies of KV blocks inside the device pool (the step's copy plan).

`block_copy.py`: `copy_blocks` (argument checks, then dispatch); `geometry.py`: the pool view
and the checks; `reference.py`: the torch path; `triton.py`: the Triton kernel (imported on use)."""
