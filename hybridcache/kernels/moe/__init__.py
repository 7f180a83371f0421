"""Routed-expert kernels of sparse MoE blocks (the routing itself stays in the layer).

`reference.py`: `routed_experts`, one gather / SiLU-gated MLP / scatter-add per expert that was picked."""
