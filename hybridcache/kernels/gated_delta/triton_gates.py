"""The gates of gated DeltaNet in one Triton launch (same math as `reference.delta_gates`, which takes torch
seven elementwise kernels): g = -exp(A_log) * softplus(a + dt_bias) in fp32, beta = sigmoid(b) rounded to b's
dtype. One program per block of rows; a and b may be strided views (Qwen3-Next slices them out of in_proj_ba).

softplus(x) = x for x > 20 (torch's threshold), else log1p(exp(x)), with log1p(y) = log(u) * y / (u - 1),
u = 1 + y (exact to a few ulps, also where y is far below fp32's epsilon around 1; y itself when u rounds to 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.kernels import pdl

_BLOCK_T = 32


@triton.jit
def softplus(x):
    """torch's softplus of fp32 x (module docstring): x above 20, else log1p(exp(x)) to a few ulps."""
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * y / (u - 1.0))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def gate_values(a, b, a_log, dt_bias):
    """The gates from fp32 a, b, A_log, dt_bias (blocks or scalars that broadcast): (g, beta) in fp32, beta not yet
    rounded. Shared by `_delta_gates_kernel` and the decode step kernel (`triton_step.py`, which fuses the gates),
    so both give the same bits."""
    decay = -tl.exp(a_log)
    return decay * softplus(a + dt_bias), 1.0 / (1.0 + tl.exp(-b))


@triton.jit(do_not_specialize=["num_rows"])  # the step's token count: one compiled variant for all
def _delta_gates_kernel(a_ptr, b_ptr, alog_ptr, dt_ptr, g_ptr, beta_ptr, num_rows, num_heads,
                        stride_a, stride_b, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_H)
    ok = (rows[:, None] < num_rows) & (heads[None, :] < num_heads)
    a = tl.load(a_ptr + rows[:, None] * stride_a + heads[None, :], mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows[:, None] * stride_b + heads[None, :], mask=ok, other=0.0).to(tl.float32)
    a_log = tl.load(alog_ptr + heads, mask=heads < num_heads, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_ptr + heads, mask=heads < num_heads, other=0.0).to(tl.float32)
    g, beta = gate_values(a, b, a_log[None, :], dt_bias[None, :])
    out = rows[:, None] * num_heads + heads[None, :]
    tl.store(g_ptr + out, g, mask=ok)
    tl.store(beta_ptr + out, beta.to(beta_ptr.dtype.element_ty), mask=ok)


def delta_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor  # noqa: N803 (checkpoint name)
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv] (unit stride on Hv); A_log, dt_bias [Hv] -> g [T, Hv] fp32, beta [T, Hv] in b's dtype."""
    num_rows, num_heads = a.shape
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        a, b = a.contiguous(), b.contiguous()
    g = torch.empty((num_rows, num_heads), dtype=torch.float32, device=a.device)
    beta = torch.empty((num_rows, num_heads), dtype=b.dtype, device=b.device)
    if num_rows:
        _delta_gates_kernel[(triton.cdiv(num_rows, _BLOCK_T),)](
            a, b, A_log, dt_bias, g, beta, num_rows, num_heads, a.stride(0), b.stride(0),
            BLOCK_T=_BLOCK_T, BLOCK_H=triton.next_power_of_2(num_heads), **pdl.options(a),
        )
    return g, beta
