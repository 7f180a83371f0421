"""Partial rotary embedding kernels: `reference` (torch, any device) and `triton` (one launch per tensor, CUDA)."""
