"""RMSNorm kernels: `reference` (torch, any device) and `triton` (fused, CUDA)."""
