"""Element-wise tails of the feed-forward blocks: `reference` (torch, any device) and `triton` (fused, CUDA)."""
