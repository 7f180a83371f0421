"""Kernels, one package per op family (the flash-linear-attention layout): `attention`, `gated_delta`,
`conv`, `moe`, `copy`. Each package holds `reference.py` (torch, CPU friendly, the ground truth) next to
its fast implementations. Layers never import a kernel module: they call the `KernelBackend` that the
runner picks once per device (`hybridcache.kernels.backend`); see docs/kernels.md.
"""
