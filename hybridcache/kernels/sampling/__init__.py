"""Sampling kernels on the device: `triton_argmax` (greedy tokens, CUDA)."""
