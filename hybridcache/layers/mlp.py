"""Feed-forward blocks: the dense SiLU-gated MLP and the sparse MoE block with a gated shared expert.

Parameter names equal the checkpoints': `gate_proj`, `up_proj`, `down_proj`; for MoE `gate` (router,
weight [E, hidden]), `experts.{e}.{gate,up,down}_proj`, `shared_expert.*`, `shared_expert_gate`
(weight [1, hidden]).

Both blocks take `(x, step)` like every block of a decoder layer; the routed experts run on `step.backend.moe`.

On CUDA the MoE block runs its shared expert on a second stream (`kernels/streams.py`), overlapping the routing and
the routed experts: at a decode step's few rows its GEMMs are latency-bound (a few microseconds each, on the critical
path of every MoE layer), while the routed experts stream their weights for tens to hundreds of microseconds
(docs/design.md, "The sparse MoE block runs its shared expert on a second CUDA stream").

Tensor parallel (`tp`): every MLP, each routed expert and the shared expert included, is split on its
intermediate dim (rows of gate_proj / up_proj, columns of down_proj), so a rank's output is a partial sum; the
router and the shared expert's gate are replicated, so every rank routes every token the same way and the MoE
block all-reduces once, routed and shared partial sums together. (Splitting each expert rather than placing
whole experts on ranks keeps every rank's work equal whatever the routing, needs no token exchange, and runs
the same expert kernels.)
"""

from __future__ import annotations

import torch
from torch import nn

import hybridcache.kernels.backend as kernel_backend
from hybridcache.layers.fused import FusedProjection
from hybridcache.layers.linear import module_swiglu_linear
from hybridcache.layers.parallel import UNSHARDED, Shard, TensorParallel, columns, rows
from hybridcache.layers.step import StepContext


def gated_mlp_shards(tp: TensorParallel, span: tuple[int, int], gate: str, up: str, down: str) -> dict[str, Shard]:
    """Parameter name -> this rank's part of a gated MLP's weights ({} unsharded) when the rank holds `span` of the
    intermediate dim: the gate and up projections' rows, the down projection's columns."""
    if tp.size == 1:
        return {}
    return {f"{gate}.weight": rows(span), f"{up}.weight": rows(span), f"{down}.weight": columns(span)}


class MLP(nn.Module):
    """x [N, hidden] -> down(silu(gate(x)) * up(x)) [N, hidden]; under tensor parallelism all-reduced when
    `reduce` (else this rank's partial sum). `field`: the config.json field of the width, named by the error of a
    tensor-parallel size that does not divide it."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, tp: TensorParallel = UNSHARDED, *, reduce: bool = True,
        field: str = "intermediate_size",
    ) -> None:
        super().__init__()
        self.tp = tp
        self.reduce = reduce
        self.span = tp.split(intermediate_size, f"the MLP width (config.json's {field})")
        intermediate_size = self.span[1] - self.span[0]
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up = FusedProjection(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        """Dense: only `step.backend` is read (its fused `silu_mul`)."""
        return self.down(*self.gate_up(x), step)

    def down(self, gate: torch.Tensor, up: torch.Tensor, step: StepContext) -> torch.Tensor:
        """The block from its gate and up projections' outputs [N, I] on: down(silu(gate) * up), all-reduced when
        `reduce`."""
        out = module_swiglu_linear(self.down_proj, gate, up, step.backend)
        return self.tp.all_reduce(out) if self.reduce else out

    def shards(self) -> dict[str, Shard]:
        """Parameter name -> this rank's part of the full parameter ({} unsharded)."""
        return gated_mlp_shards(self.tp, self.span, "gate_proj", "up_proj", "down_proj")


class SparseMoeBlock(nn.Module):
    """Top-k routed experts plus a sigmoid-gated shared expert; x [N, hidden] -> [N, hidden].

    Routing (transformers' Qwen3-Next / Qwen3.5-MoE): probs = softmax(gate(x)) in fp32, keep the top-k,
    renormalise them to sum 1 when `norm_topk_prob`; out = sum_k w_k expert_k(x)
    + sigmoid(shared_expert_gate(x)) * shared_expert(x). The four projections of x (the shared expert's gate and
    up, the router, the shared expert's gate) run as one GEMM where they fuse (`inputs`). Where they do not
    (FP8 projections beside the bf16 router), a backend may run the shared expert with the routed experts
    (`KernelBackend.fuses_shared_expert`: FP8 on CUDA, as one more expert of their stack).
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        num_experts: int,
        top_k: int,
        moe_intermediate_size: int,
        shared_expert_intermediate_size: int,
        norm_topk_prob: bool,
        tp: TensorParallel = UNSHARDED,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(hidden_size, moe_intermediate_size, tp, reduce=False, field="moe_intermediate_size")
            for _ in range(num_experts)
        )
        self.shared_expert = MLP(hidden_size, shared_expert_intermediate_size, tp, reduce=False,
                                 field="shared_expert_intermediate_size")
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.gates = FusedProjection(self.gate, self.shared_expert_gate)
        # every projection of x in one GEMM (the small ones cost a launch each whatever their size): the shared
        # expert's gate | up, the router, the shared expert's gate; when these cannot fuse (an FP8 shared expert
        # beside a bf16 router, scale blocks that straddle), `gates` and the shared expert's own gate | up
        self.inputs = FusedProjection(self.shared_expert.gate_proj, self.shared_expert.up_proj, self.gate,
                                      self.shared_expert_gate)

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        """Where the backend has a side stream (CUDA), the shared expert's output is computed there and handed to
        `moe` pending; `moe` makes the main stream wait for it right before the combine that adds it. With the one
        fused input GEMM, its SwiGLU and down projection run there; with separate ones (FP8 beside the bf16 router),
        its gate | up too, after the router's GEMM (no dense or FP8 linear may run on the main stream between a fork
        and its join: `kernels/streams.py`, device scratch). The pending result keeps the tensors the side stream
        reads (the fused GEMM's gate and up, or x) referenced until this returns, after that join
        (`kernels/streams.py`: why the allocator's reuse of their memory is safe)."""
        side = step.backend.side_stream(x.device)
        shared: torch.Tensor | kernel_backend.Pending | nn.Module  # the shared expert's output (pending), or its module
        if self.inputs.fused():
            gate, up, router_logits, shared_gate = self.inputs(x)
            shared = kernel_backend.fork(side, self.shared_expert.down, gate, up, step)
        else:
            router_logits, shared_gate = self.gates(x)
            if step.backend.fuses_shared_expert(self.experts, self.shared_expert):  # FP8 on CUDA: one more expert
                shared = self.shared_expert
            else:
                shared = kernel_backend.fork(side, self.shared_expert, x, step)
        top_weights, top_ids = step.backend.route(router_logits, self.top_k, self.norm_topk_prob)  # [N, k] each
        # the shared expert's output is added with its gate in the routed experts' combine
        return self.tp.all_reduce(step.backend.moe(x, top_weights, top_ids, self.experts, (shared_gate, shared)))
