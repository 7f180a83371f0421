"""Batched copies of KV blocks and state slots inside the device pools (the step's copy plan).

`block_copy.py`: `copy_blocks`, `copy_slots` (argument checks, then dispatch); `geometry.py`: the pool view
and the checks; `reference.py`: the torch path; `triton.py`: the Triton kernel (imported on use)."""
