"""Routed-expert kernels of sparse MoE blocks (the routing itself stays in the layer).

`reference.py`: `routed_experts`, one gather / expert MLP (SiLU-gated, or relu^2 ungated: `EXPERT_ACTIVATIONS`) /
scatter-add per expert that was picked.
CUDA: `grouped.py` (sort, the two expert paths, combine), `triton_experts.py` (the expert GEMM over sorted rows
and the combine kernel), `triton_route.py` (routing in one launch)."""
