"""Torch reference of Mamba1's selective scan (Jamba's recurrent layers), one sequence per call unless stated.

Notation: T new tokens, I channels (d_inner), N the state size. Unlike Mamba2, whose decay is one scalar per head,
every channel d has its own decay per state entry n (A [I, N]) and the state is S [I, N]. Per token t, in fp32:

    dt_t = softplus(dt_raw_t + dt_bias)                                  [I]      (`mamba2.reference.discretized_dt`)
    S_t  = exp(dt_t[:, None] * A) * S_{t-1} + (dt_t * x_t)[:, None] * B_t[None, :]       S [I, N], A = -exp(A_log)
    y_t  = (S_t C_t + D * x_t) * silu(z_t)                               [I]      (no gate when z is None)

Worked example, I = 1 channel, N = 2, A = (-1, -2), S_0 = (0, 0), dt = 1, x = 1, B = (1, 1), C = (1, 0):
S_1 = (1, 1), y_1 = 1 + D; a second identical token gives S_2 = (e^-1 + 1, e^-2 + 1), y_2 = 1.37 + D.

`selective_scan` runs a sequence token by token (the recurrence has no chunked form with a scalar decay to lean on),
the decays and writes of a block of tokens computed at once and the readout of the block in one product;
`selective_step` is one token of M sequences (decode); `selective_states_after` keeps every state (speculative
decoding's verify rows). All three give the same numbers to fp32 rounding; transformers' `mamba_selective_scan` and
`mamba_selective_state_update` (`JambaMambaMixer`'s torch path) compute the same recurrence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_TOKENS = 64  # tokens whose decays and writes `selective_scan` materialises at once ([L, I, N] fp32 each)


def _gated(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:  # noqa: N803
    """(y + D x) * silu(z) in fp32 (without the gate when z is None)."""
    y = y + x.float() * D.float()
    return y if z is None else y * F.silu(z.float())


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,  # noqa: N803 (the paper's names)
    B: torch.Tensor,  # noqa: N803
    C: torch.Tensor,  # noqa: N803
    D: torch.Tensor,  # noqa: N803
    z: torch.Tensor | None,
    initial_state: torch.Tensor | None = None,
    *,
    block_tokens: int = BLOCK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over one sequence (module docstring).

    x             [T, I]
    dt            [T, I]     discretized (softplus(dt_raw + dt_bias)), > 0
    A             [I, N]     -exp(A_log) (< 0)
    B, C          [T, N]
    D             [I]        skip connection
    z             [T, I] or None   the gate (y times silu(z))
    initial_state [I, N]     state before the first token (None = zeros); any dtype, read as fp32
    returns       y [T, I] fp32 (skip and gate included), final state [I, N] fp32
    """
    num_tokens, channels = x.shape
    A = A.float()  # noqa: N806
    state = (torch.zeros(channels, A.shape[-1], dtype=torch.float32, device=x.device)
             if initial_state is None else initial_state.float())
    y = torch.empty(num_tokens, channels, dtype=torch.float32, device=x.device)
    for start in range(0, num_tokens, block_tokens):
        rows = slice(start, min(start + block_tokens, num_tokens))
        dtb = dt[rows].float()
        decay = torch.exp(dtb[..., None] * A)  # [L, I, N]
        states = (dtb * x[rows].float())[..., None] * B[rows].float()[:, None, :]  # writes, then states, [L, I, N]
        for t in range(states.shape[0]):
            state = torch.addcmul(states[t], decay[t], state, out=states[t])
        y[rows] = torch.einsum("lin,ln->li", states, C[rows].float())
    return _gated(y, x, D, z), state.clone()  # (not a view keeping the last block's states)


def selective_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,  # noqa: N803
    B: torch.Tensor,  # noqa: N803
    C: torch.Tensor,  # noqa: N803
    D: torch.Tensor,  # noqa: N803
    z: torch.Tensor | None,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of M sequences (the recurrence of the module docstring).

    x, dt [M, I] (dt discretized); A [I, N]; B, C [M, N]; D [I]; z [M, I] or None; state [M, I, N] (any dtype, read
    as fp32). Returns y [M, I] fp32 (skip and gate included), new state [M, I, N] fp32.
    """
    dt = dt.float()
    state = state.float() * torch.exp(dt[..., None] * A.float()) + (dt * x.float())[..., None] * B.float()[:, None, :]
    y = torch.einsum("min,mn->mi", state, C.float())
    return _gated(y, x, D, z), state


def selective_states_after(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,  # noqa: N803
    B: torch.Tensor,  # noqa: N803
    C: torch.Tensor,  # noqa: N803
    D: torch.Tensor,  # noqa: N803
    z: torch.Tensor | None,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence token by token, keeping every state (speculative decoding's verify rows).

    x, dt [T, I]; B, C [T, N]; z [T, I] or None; initial_state [I, N]
    returns y [T, I] fp32, states [T, I, N] fp32 (entry t: the state after token t)
    """
    outputs, states = [], []
    state = initial_state[None]
    for t in range(x.shape[0]):
        gate = None if z is None else z[t : t + 1]
        y, state = selective_step(x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D, gate, state)
        outputs.append(y[0])
        states.append(state[0])
    return torch.stack(outputs), torch.stack(states)
