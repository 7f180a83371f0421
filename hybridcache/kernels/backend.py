"""The kernel backend seam: the batch-level ops every layer calls, and the torch reference backend.

The runner picks one backend per device, once (`get_backend`; its attention by name from the registry of
`hybridcache.kernels.registry`), and per step calls `prepare(batch)`,
which returns the batch with the backend's step metadata attached (`batch.metadata`). The model passes
that prepared batch to the ops. Every op works on the whole varlen batch at once:

- rows: token `t` of sequence `i` is row `batch.cu_seqlens[i] + t` of every [T, ...] tensor;
- state rows: sequence `i` reads and writes row `batch.state_slots[i]` of a recurrent state tensor;
- fresh sequences (`context_len == query_len`, the first chunk of a sequence) start from zero recurrent
  and conv state whatever their slot holds; every other sequence continues from its slot;
- KV: the new keys/values go to flat rows `batch.kv_rows`; a sequence's query at position p sees keys
  at positions <= p of its pages `batch.block_tables[i]`.

Backends may not change results beyond float rounding; the reference backend defines them. Only
`ReferenceBackend` loops over sequences in Python and reads device tensors on the host, and only inside
`prepare` and the reference kernels (`kernels/*/reference.py`).

Notation: T tokens of the step, S sequences, Hq / Hkv attention query / kv heads, D attention head dim,
C conv channels, K conv kernel size, Hk / Hv DeltaNet key / value heads, Dk / Dv their head dims,
H hidden size, k experts per token, E experts, I expert width; Mamba2: Hm heads of Pm channels, G groups, N state
size; Mamba1: I channels (its d_inner), N state size.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from hybridcache.forward_batch import ForwardBatch
from hybridcache.fp8_format import Fp8Format
from hybridcache.kernels import streams
from hybridcache.kernels.activation import reference as activation_ref
from hybridcache.kernels.attention import latent
from hybridcache.kernels.attention.base import AttentionBackend
from hybridcache.kernels.attention.reference_backend import ReferenceAttention
from hybridcache.kernels.conv import reference as conv_ref
from hybridcache.kernels.encoder_attention import default_encoder_attention
from hybridcache.kernels.encoder_attention.base import EncoderAttention
from hybridcache.kernels.gated_delta import reference as delta_ref
from hybridcache.kernels.gemm import dense as dense_gemm
from hybridcache.kernels.gemm.base import GemmBackend
from hybridcache.kernels.mamba1 import reference as mamba1_ref
from hybridcache.kernels.mamba2 import reference as mamba2_ref
from hybridcache.kernels.moe import reference as moe_ref
from hybridcache.kernels.norm import reference as norm_ref
from hybridcache.kernels.norm.reference import Weighting
from hybridcache.kernels.registry import ATTENTION, ENCODER_ATTENTION, GEMM
from hybridcache.kernels.rotary import reference as rotary_ref
from hybridcache.kernels.shapes import ModelShapes, refuse
from hybridcache.kernels.streams import Pending, joined


class KernelBackend(Protocol):
    """The ops layers call. All tensors live on the batch's device; ops never synchronise with the host
    except inside `ReferenceBackend`. Ops must be given the batch returned by `prepare`."""

    def check_model(self, shapes: ModelShapes) -> None:
        """At load, before the weights: raise `kernels.shapes.UnsupportedModelError` naming every reason this
        backend cannot run a model of these shapes."""
        ...

    def prepare(self, batch: ForwardBatch) -> ForwardBatch:
        """Once per step, before the forward: return `batch` with this backend's metadata in
        `batch.metadata` (e.g. decode rows, fresh mask, attention plans, static buffers for graphs)."""
        ...

    def workspace_bytes(self, shapes: ModelShapes, num_tokens: int, dtype: torch.dtype) -> int:
        """The most bytes a step of up to `num_tokens` tokens of a model of these shapes in `dtype` may hold beyond
        what a profiling forward of that many fresh tokens shows (0 for most; the engine keeps it out of the pools
        on CUDA, `rank_runner._cuda_budget`)."""
        ...

    def write_kv(self, kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: ForwardBatch) -> None:
        """Write the step's keys and values into one layer's paged pool, in place.

        kv_layer   [2, num_pages, kernel_block_size, Hkv, D]   (0 = keys, 1 = values)
        key, value [T, Hkv, D]; token t goes to flat row batch.kv_rows[t] = page * kernel_block_size + offset
        """
        ...

    def attention(
        self, query: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch, *, scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """Causal GQA attention of every sequence over its pages (the step's KV already written).

        query    [T, Hq, D]; kv_layer [2, num_pages, kernel_block_size, Hkv, D]
        kv_scales (k_scale, v_scale) of an FP8 (float8_e4m3fn) pool: keys and values read as stored x scale
        returns  [T, Hq, D] in query's dtype. Query head h reads kv head h // (Hq / Hkv); the query at
                 position p (batch.positions) sees keys at positions 0..p of its sequence; softmax in fp32.
        """
        ...

    def mla_attention(
        self, q_nope: torch.Tensor, q_shared: torch.Tensor, rows: torch.Tensor, w_uk: torch.Tensor,
        w_uv: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch, *, scale: float,
    ) -> torch.Tensor:
        """Kimi Linear's multi-head latent attention over one layer's pool of latent rows (the layout and the
        maths: `kernels/attention/latent.py`): write the step's rows, then causal attention of every head.

        q_nope [T, H, Dn], q_shared [T, H, Dr]; rows [T, E = R + Dr]: token t's row goes to flat row
        batch.kv_rows[t], its first ceil(E / 2) lanes into the keys half, the rest into the values half
        (`latent.split_rows`); w_uk [H, Dn, R], w_uv [H, Dv, R]: kv_b_proj's halves; kv_layer [2, num_pages,
        kernel_block_size, 1, ceil(E / 2)]
        returns  [T, H, Dv]: head h's softmax over its keys [W_UK_h c_j | k_shared_j] (scale), times its values
                 W_UV_h c_j; computed absorbed (`latent.absorbed_attention`) or, for a prefill step on CUDA,
                 expanded (`mla_prefill.py`)
        """
        ...

    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_layer: torch.Tensor,
        batch: ForwardBatch,
        *,
        activation: str | None = "silu",
        gates: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Depthwise causal convolution with SiLU (`activation` None: without, LFM2's short convolution), per
        sequence, continuing from its conv state.

        x          [T, C]   pre-convolution inputs
        weight     [C, K];  bias [C] or None
        conv_layer [num_slots, C, K-1]   the last K-1 inputs of each slot, oldest first; updated in place
                   for every sequence of the batch (fresh sequences read zeros instead of their row)
        gates      (b, c), each [T, C], or None: the inputs are b * x and the result is multiplied by c (LFM2's
                   gated short convolution, `c * conv(b * x)` with each product in x's dtype; the state keeps b * x)
        returns    [T, C] in x's dtype: silu(sum_j weight[:, j] * window[j] + bias)
        """
        ...

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        ssm_layer: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """The gated delta rule per sequence, continuing from its recurrent state (q, k l2-normalised here).

        q, k      [T, Hk, Dk];  v [T, Hv, Dv];  g [T, Hv] fp32 log decay (<= 0);  beta [T, Hv] in (0, 1), or in
                  (0, 2) (OLMo Hybrid's allow_neg_eigval: `delta_gates`' beta doubled before this op); or g
                  [T, Hv, Dk] fp32, a decay per key channel (Kimi Delta Attention: S = diag(exp(g)) S)
        ssm_layer [num_slots, Hv, Dk, Dv]   state S of each slot (fp32 by default); updated in place for every
                  sequence (fresh sequences start from zeros)
        returns   [T, Hv, Dv] in q's dtype. Per token: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q / sqrt(Dk)
        """
        ...

    def gated_delta(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,  # noqa: N803 (the checkpoint's name)
        dt_bias: torch.Tensor,
        ssm_layer: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """`delta_gates(a, b, A_log, dt_bias)` and then `gated_delta_rule` with those gates, as one op (a backend may
        fuse the gates into the rule's kernel; the results are those of the two ops)."""
        ...

    def conv_gated_delta(
        self,
        mixed_qkv: torch.Tensor,
        conv_weight: torch.Tensor,
        conv_bias: torch.Tensor | None,
        conv_layer: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,  # noqa: N803 (the checkpoint's name)
        dt_bias: torch.Tensor,
        ssm_layer: torch.Tensor,
        batch: ForwardBatch,
        *,
        num_k_heads: int,
    ) -> torch.Tensor:
        """Gated DeltaNet's core as one op: `causal_conv1d(mixed_qkv, conv_weight, conv_bias, conv_layer)`, its
        output split into q, k [T, Hk, Dk] | v [T, Hv, Dv] (`gated_delta.reference.split_qkv`; Hk = num_k_heads, Dk
        and Dv from ssm_layer), then `gated_delta(q, k, v, a, b, A_log, dt_bias, ssm_layer)`. The results (output,
        both state layers) are those of the three ops (a backend may fuse them)."""
        ...

    def ssd_scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        B: torch.Tensor,  # noqa: N803 (Mamba2's names)
        C: torch.Tensor,  # noqa: N803
        A_log: torch.Tensor,  # noqa: N803
        dt_bias: torch.Tensor,
        D: torch.Tensor,  # noqa: N803
        ssm_layer: torch.Tensor,
        batch: ForwardBatch,
        *,
        dt_limit: tuple[float, float],
    ) -> torch.Tensor:
        """Mamba2's selective scan per sequence, continuing from its recurrent state (`kernels/mamba2/reference.py`).

        x         [T, Hm, Pm];  dt [T, Hm] raw (before dt_bias, softplus and the dt_limit clamp);  B, C [T, G, N]
        A_log, dt_bias, D [Hm]   (A = -exp(A_log))
        ssm_layer [num_slots, Hm, Pm, N]   state S of each slot (fp32 by default); updated in place for every
                  sequence (fresh sequences start from zeros)
        returns   [T, Hm, Pm] fp32. Per token: S = exp(dt A) S + dt x (x) B; y = S C + D x
        """
        ...

    def selective_scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        B: torch.Tensor,  # noqa: N803 (Mamba's names)
        C: torch.Tensor,  # noqa: N803
        A_log: torch.Tensor,  # noqa: N803
        dt_bias: torch.Tensor,
        D: torch.Tensor,  # noqa: N803
        z: torch.Tensor | None,
        ssm_layer: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Mamba1's selective scan per sequence, continuing from its recurrent state (`kernels/mamba1/reference.py`).

        x         [T, I];  dt [T, I] raw (before dt_bias and softplus);  B, C [T, N];  z [T, I] the gate, or None
        A_log     [I, N]   (A = -exp(A_log));  dt_bias, D [I]
        ssm_layer [num_slots, I, N]   state S of each slot (fp32 by default); updated in place for every
                  sequence (fresh sequences start from zeros)
        returns   [T, I] fp32. Per token: dt = softplus(dt + dt_bias); S = exp(dt A) S + (dt x) (x) B;
                  y = (S C + D x) * silu(z)
        """
        ...

    def gated_group_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                             group_size: int, norm_before_gate: bool = False) -> torch.Tensor:
        """Mamba2's gated RMSNorm (the norm per group of `group_size` channels): x, gate [T, I], weight [I] ->
        weight * norm(x * silu(gate)) [T, I] (the gate first), or with `norm_before_gate` weight * norm(x) *
        silu(gate) (Falcon-H1's), in gate's dtype, in fp32 and rounded once."""
        ...

    def delta_gates(
        self, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor  # noqa: N803
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gated DeltaNet's per-head gates: a, b [T, Hv]; A_log, dt_bias [Hv] -> g [T, Hv] fp32 =
        -exp(A_log) * softplus(a + dt_bias) (the log decay of `gated_delta_rule`) and beta = sigmoid(b) in b's dtype."""
        ...

    def route(self, logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k MoE routing: logits [T, E] -> softmax in fp32, the top_k largest in descending order, renormalised
        to sum 1 when `renormalize`; returns (weights [T, k] in logits' dtype, ids [T, k] int64)."""
        ...

    def route_sigmoid(self, logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, eps: float,
                      scale: float, num_groups: int = 1, topk_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmoid routing with a correction bias, in fp32 (`moe/reference.route_sigmoid`: Nemotron-H's, Kimi
        Linear's and LFM2-MoE's routers): logits [T, E] fp32, bias [E] fp32 -> (weights [T, k] fp32, ids [T, k]
        int64); the order of a row's picks is the backend's (torch.topk's unsorted order, or descending)."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 weighting: Weighting = Weighting.ZERO_CENTRED) -> torch.Tensor:
        """RMSNorm over the last dim: x [..., dim], weight [dim] -> [..., dim] in x's dtype, n = x / sqrt(mean(x^2)
        + eps) in fp32 weighted as `weighting` says (`kernels.norm.reference.Weighting`): zero-centred n * (1 +
        weight) rounded once (Qwen's), or weight * n, multiplying the rounded n or n in fp32 (the other families')."""
        ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
        weighting: Weighting = Weighting.ZERO_CENTRED, scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual add and the RMSNorm after it: x, residual [..., dim] (one dtype), weight [dim] ->
        (s, rms_norm(s, weighting)) with s = x + residual rounded to x's dtype (as torch's add rounds it), both in
        x's dtype; `scale` != 1: s = x + residual * scale, the product rounded first (Granite's residual
        multiplier, as transformers computes it)."""
        ...

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Gated RMSNorm over the last dim: x, gate [..., dim], weight [dim] -> [..., dim] in x's dtype,
        y = (weight * round(x / sqrt(mean(x^2) + eps))) * silu(gate) (round: to x's dtype; the rest in fp32)."""
        ...

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The SiLU-gated MLP's hidden activation: gate, up [N, I] (column views of one fused projection's output
        allowed) -> silu(gate) * up [N, I], each op's result rounded to the dtype as torch rounds it. `up` may be
        float32 beside a bf16 / fp16 gate (Mamba2's ungated output y * silu(z)): the product in fp32, rounded once
        to gate's dtype, as `(F.silu(gate) * up).to(gate.dtype)`."""
        ...

    def sigmoid_gate_add(self, routed: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """A sparse MoE block's output: routed, shared [N, H], gate [N, 1] (a column view allowed) ->
        routed + sigmoid(gate) * shared [N, H], each op's result rounded to the dtype as torch rounds it."""
        ...

    def relu_square(self, x: torch.Tensor) -> torch.Tensor:
        """The ungated relu^2 MLP's hidden activation (Nemotron-H): x [N, I] -> relu(x)^2 [N, I], rounded once to x's
        dtype as torch's square rounds it."""
        ...

    def sigmoid_mul(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The gated attention's output gate: x, gate [T, H, D] (head views allowed) -> x * sigmoid(gate),
        contiguous [T, H, D], each op's result rounded to the dtype as torch rounds it."""
        ...

    def norm_rotary(self, query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                    eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention layer's q_norm / k_norm and rotary in one op: `rotary(rms_norm(query, q_weight, eps),
        rms_norm(key, k_weight, eps), cos, sin)` (the norms' outputs rounded to the dtype before the rotation)."""
        ...

    def rotary(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial rotary embedding (rotate-half): query [T, Hq, D], key [T, Hk, D], cos/sin [T, R] with R <= D
        -> new rotated query and key; the first R channels of each head rotated, the rest unchanged."""
        ...

    def fuses_shared_expert(self, experts: Sequence[nn.Module], shared_expert: nn.Module) -> bool:
        """Whether `moe` takes this block's shared expert module itself (`shared` = (gate, module)) and runs it
        with the routed experts, instead of its output. Decided from the modules alone (the same on every call)."""
        ...

    def side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The stream a layer may run work on beside the current one (through `fork`: `kernels/streams.py`), or
        None: run it inline. One per device, the same on every call."""
        ...

    def moe(
        self, x: torch.Tensor, top_weights: torch.Tensor, top_ids: torch.Tensor, experts: Sequence[nn.Module],
        shared: tuple[torch.Tensor | None, torch.Tensor | Pending | nn.Module] | None = None,
        activation: str = "silu_gated",
    ) -> torch.Tensor:
        """The routed experts of a sparse MoE block (routing is done by the layer).

        x           [T, H];  top_weights [T, k] in x's dtype (or float32: each weighted expert output is then
                    formed in float32 before it is rounded and summed);  top_ids [T, k] int64 in [0, E)
        experts     E modules with `gate_proj.weight`, `up_proj.weight` [I, H] and `down_proj.weight` [H, I]
                    ("relu2": no `gate_proj`); one block's experts always come with the same activation
        activation  the experts' MLP (`moe.reference.EXPERT_ACTIVATIONS`): "silu_gated" down(silu(gate(x)) * up(x))
                    (Qwen, Granite), or "relu2" down(relu(up(x))^2) (Nemotron-H's ungated experts)
        shared      None, or (gate [T, 1], shared [T, H]) in x's dtype: the shared expert's output and its gate
                    (gate None: an ungated shared MLP, added as it is: Granite's);
                    the output may be pending on the device's side stream (`kernels.streams.Pending`): then `moe`
                    joins it (`streams.joined`: the current stream waits for the side stream) after launching the
                    routed experts and before the first kernel that reads it, always, exactly once per call, and
                    launches no dense or FP8 linear before that join (the side stream may be running one:
                    `kernels/streams.py`, device scratch); or, where `fuses_shared_expert` holds, (gate, the shared
                    expert's module), its output computed here
        returns     [T, H]: out[t] = sum_j top_weights[t, j] * expert_{top_ids[t, j]}(x[t]) (the activation's MLP)
                    (+ `sigmoid_gate_add`'s sigmoid(gate[t]) * shared[t] with `shared`, rounded as it rounds; gate
                    None: + shared[t], the rounded sum plus it, rounded; with the module, to float rounding)
        """
        ...


class SharedOps:
    """The ops `ReferenceBackend` and `CudaBackend` run alike: `write_kv` and `attention` by their
    `attention_backend` (with what its `prepare` returned: the step metadata's `attention`), and `conv_gated_delta`
    as its three ops (`causal_conv1d`, `split_qkv`, `gated_delta`; one launch for the three was measured slower on
    CUDA in the engine's step: docs/bench.md, session 44, dec17a). A subclass sets `attention_backend` and
    `step_metadata`, its metadata of a prepared batch (a ValueError for one its `prepare` did not make)."""

    attention_backend: AttentionBackend
    step_metadata: Callable[[ForwardBatch], Any]

    def write_kv(self, kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: ForwardBatch) -> None:
        self.attention_backend.write_kv(kv_layer, key, value, batch)

    def workspace_bytes(self, shapes: ModelShapes, num_tokens: int, dtype: torch.dtype) -> int:
        """None beyond the profiled forward (`KernelBackend.workspace_bytes`); `CudaBackend` says otherwise for MLA."""
        del shapes, num_tokens, dtype
        return 0

    def attention(
        self, query: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch, *, scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        return self.attention_backend.attention(query, kv_layer, batch, self.step_metadata(batch).attention,
                                                scale=scale, kv_scales=kv_scales)

    def conv_gated_delta(
        self, mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
        conv_layer: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,  # noqa: N803
        dt_bias: torch.Tensor, ssm_layer: torch.Tensor, batch: ForwardBatch, *, num_k_heads: int,
    ) -> torch.Tensor:
        conv_out = self.causal_conv1d(mixed_qkv, conv_weight, conv_bias, conv_layer, batch)
        q, k, v = delta_ref.split_qkv(conv_out, num_k_heads, ssm_layer.shape[2], ssm_layer.shape[3])
        return self.gated_delta(q, k, v, a, b, A_log, dt_bias, ssm_layer, batch)


@dataclass(frozen=True)
class DecodeRows:
    """Sequences of a step that feed one token each, processed together by the reference ops.

    seq_ids  the sequences (batch order); rows [N] int64: their token's row; slots [N] int64: their state rows.
    """

    seq_ids: tuple[int, ...]
    rows: torch.Tensor
    slots: torch.Tensor


@dataclass(frozen=True)
class ReferenceMetadata:
    """What `ReferenceBackend.prepare` derives once per step (host ints and the decode groups).

    seq_starts   first row of each sequence (cu_seqlens[:-1] on the host)
    state_slots  state row of each sequence, on the host
    fresh        per sequence: context_len == query_len (starts from zero state)
    state_decode sequences with one token continuing a saved state (query_len 1, context_len > 1), or None
    attention    what the attention backend's `prepare` returned
    """

    seq_starts: tuple[int, ...]
    state_slots: tuple[int, ...]
    fresh: tuple[bool, ...]
    state_decode: DecodeRows | None
    attention: Any = None


def _metadata(batch: ForwardBatch) -> ReferenceMetadata:
    if not isinstance(batch.metadata, ReferenceMetadata):
        raise ValueError("the batch was not prepared by ReferenceBackend.prepare")
    return batch.metadata


class ReferenceBackend(SharedOps):
    """The torch reference kernels behind the `KernelBackend` ops (any device; the CPU ground truth).

    Recurrent ops: sequences decoding one token from a saved state go through the batched step kernels
    (`causal_conv1d_step`, `gated_delta_rule_step`, Mamba2's `ssd_step`, Mamba1's `selective_step`); every other
    sequence runs alone through the sequence kernels (`causal_conv1d`, `chunk_gated_delta_rule`, or
    `recurrent_gated_delta_rule` for one fresh token; Mamba2's `ssd_chunk_scan`, Mamba1's `selective_scan`); a verify
    row of speculative decoding (`batch.draft_slots_cpu`) runs its positions as decode steps
    (`gated_delta_rule_verify`, `ssd_states_after`, `selective_states_after`) and keeps the conv and recurrent
    state after each of its first n positions in its draft rows. Attention: its `attention_backend` (default
    `ReferenceAttention`: `paged_attention`).
    """

    supports_verify_states = True  # speculative decoding's verify rows (a backend without it is refused)

    def __init__(self, attention_backend: AttentionBackend | None = None) -> None:
        self.attention_backend = attention_backend if attention_backend is not None else ReferenceAttention()

    def check_model(self, shapes: ModelShapes) -> None:
        """The reference kernels run any shapes; its attention backend may refuse some."""
        refuse("reference", self.attention_backend.problems(shapes))

    def prepare(self, batch: ForwardBatch) -> ForwardBatch:
        starts, total = [], 0
        for query_len in batch.query_lens_cpu:
            starts.append(total)
            total += query_len
        slots = tuple(batch.state_slots.tolist())
        lens = tuple(zip(batch.query_lens_cpu, batch.context_lens_cpu, strict=True))
        decode_ids = [i for i, (query_len, context_len) in enumerate(lens) if query_len == 1 and context_len > 1]
        state_decode = None
        if decode_ids:
            device = batch.input_ids.device
            state_decode = DecodeRows(
                seq_ids=tuple(decode_ids),
                rows=torch.tensor([starts[i] for i in decode_ids], device=device),
                slots=batch.state_slots[decode_ids],
            )
        metadata = ReferenceMetadata(
            seq_starts=tuple(starts),
            state_slots=slots,
            fresh=tuple(query_len == context_len for query_len, context_len in lens),
            state_decode=state_decode,
            attention=self.attention_backend.prepare(batch),
        )
        return dataclasses.replace(batch, metadata=metadata)

    def mla_attention(
        self, q_nope: torch.Tensor, q_shared: torch.Tensor, rows: torch.Tensor, w_uk: torch.Tensor,
        w_uv: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch, *, scale: float,
    ) -> torch.Tensor:
        self.write_kv(kv_layer, *latent.split_rows(rows), batch)

        def attend(absorbed: torch.Tensor) -> torch.Tensor:
            return latent.latent_attention(absorbed, kv_layer, batch.block_tables, batch.cu_seqlens,
                                           batch.query_lens_cpu, batch.context_lens_cpu, scale=scale,
                                           value_dim=w_uk.shape[-1])

        return latent.absorbed_attention(q_nope, q_shared, w_uk, w_uv, attend)

    def causal_conv1d(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        conv_layer: torch.Tensor,
        batch: ForwardBatch,
        *,
        activation: str | None = "silu",
        gates: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        meta = _metadata(batch)
        if gates is not None:
            x = gates[0] * x
        out = torch.empty_like(x)
        for i, rows in _sequence_rows(batch, meta):
            slot = meta.state_slots[i]
            drafts = batch.draft_slots_cpu[i] if batch.draft_slots_cpu else ()
            if drafts:  # a verify row: keep the state after each of its first n positions
                after = conv_ref.conv_states_after(x[rows], conv_layer[slot])
                conv_layer[list(drafts)] = after[: len(drafts)]
            out[rows], conv_layer[slot] = conv_ref.causal_conv1d(
                x[rows], weight, bias, None if meta.fresh[i] else conv_layer[slot], activation=activation
            )
        decode = meta.state_decode
        if decode is not None:
            out[decode.rows], state = conv_ref.causal_conv1d_step(
                x[decode.rows], weight, bias, conv_layer[decode.slots], activation=activation
            )
            conv_layer.index_copy_(0, decode.slots, state)
        return out if gates is None else gates[1] * out

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        ssm_layer: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        meta = _metadata(batch)
        out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
        for i, rows in _sequence_rows(batch, meta):
            slot = meta.state_slots[i]
            drafts = batch.draft_slots_cpu[i] if batch.draft_slots_cpu else ()
            if drafts:  # a verify row: decode steps one position at a time, keeping each position's state
                out[rows], states = delta_ref.gated_delta_rule_verify(
                    q[rows], k[rows], v[rows], g[rows], beta[rows], ssm_layer[slot]
                )
                ssm_layer[list(drafts)] = states[: len(drafts)]
                ssm_layer[slot] = states[-1]
                continue
            rule = (
                delta_ref.recurrent_gated_delta_rule
                if batch.query_lens_cpu[i] == 1
                else delta_ref.chunk_gated_delta_rule
            )
            out[rows], ssm_layer[slot] = rule(
                q[rows], k[rows], v[rows], g[rows], beta[rows], None if meta.fresh[i] else ssm_layer[slot]
            )
        decode = meta.state_decode
        if decode is not None:
            rows = decode.rows
            out[rows], state = delta_ref.gated_delta_rule_step(
                q[rows], k[rows], v[rows], g[rows], beta[rows], ssm_layer[decode.slots]
            )
            ssm_layer.index_copy_(0, decode.slots, state.to(ssm_layer.dtype))
        return out

    def ssd_scan(
        self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
        A_log: torch.Tensor, dt_bias: torch.Tensor, D: torch.Tensor, ssm_layer: torch.Tensor,  # noqa: N803
        batch: ForwardBatch, *, dt_limit: tuple[float, float],
    ) -> torch.Tensor:
        return mamba2_scan(x, dt, B, C, A_log, dt_bias, D, ssm_layer, batch, dt_limit=dt_limit,
                           decode=_metadata(batch).state_decode)

    def selective_scan(
        self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
        A_log: torch.Tensor, dt_bias: torch.Tensor, D: torch.Tensor, z: torch.Tensor | None,  # noqa: N803
        ssm_layer: torch.Tensor, batch: ForwardBatch,
    ) -> torch.Tensor:
        return mamba1_scan(x, dt, B, C, A_log, dt_bias, D, z, ssm_layer, batch, decode=_metadata(batch).state_decode)

    def fuses_shared_expert(self, experts: Sequence[nn.Module], shared_expert: nn.Module) -> bool:
        return False  # the layer runs the shared expert and passes its output

    def side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        return None  # one op after another, on any device

    def moe(
        self, x: torch.Tensor, top_weights: torch.Tensor, top_ids: torch.Tensor, experts: Sequence[nn.Module],
        shared: tuple[torch.Tensor | None, torch.Tensor | Pending] | None = None, activation: str = "silu_gated",
    ) -> torch.Tensor:
        gated = activation != moe_ref.RELU2
        routed = moe_ref.routed_experts(
            x,
            top_weights,
            top_ids,
            _DenseWeights([e.gate_proj for e in experts], x.dtype) if gated else None,
            _DenseWeights([e.up_proj for e in experts], x.dtype),
            _DenseWeights([e.down_proj for e in experts], x.dtype),
            activation,
        )
        return add_shared(routed, shared, activation_ref.sigmoid_gate_add)

    def gated_delta(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
        A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_layer: torch.Tensor, batch: ForwardBatch,  # noqa: N803
    ) -> torch.Tensor:
        g, beta = self.delta_gates(a, b, A_log, dt_bias)
        return self.gated_delta_rule(q, k, v, g, beta, ssm_layer, batch)

    step_metadata = staticmethod(_metadata)
    # Element-wise and per-row ops need no step metadata: the kernel functions themselves.
    delta_gates = staticmethod(delta_ref.delta_gates)
    route = staticmethod(moe_ref.route)
    route_sigmoid = staticmethod(moe_ref.route_sigmoid)
    rms_norm = staticmethod(norm_ref.rms_norm)
    add_rms_norm = staticmethod(norm_ref.add_rms_norm)
    gated_rms_norm = staticmethod(norm_ref.gated_rms_norm)
    gated_group_rms_norm = staticmethod(mamba2_ref.gated_group_rms_norm)
    silu_mul = staticmethod(activation_ref.silu_mul)
    sigmoid_gate_add = staticmethod(activation_ref.sigmoid_gate_add)
    sigmoid_mul = staticmethod(activation_ref.sigmoid_mul)
    relu_square = staticmethod(activation_ref.relu_square)
    rotary = staticmethod(rotary_ref.rotary)
    norm_rotary = staticmethod(rotary_ref.norm_rotary)


class _DenseWeights(Sequence[torch.Tensor]):
    """The weights of a list of linear layers as dense matrices, made when read: an `nn.Linear`'s own weight, an
    FP8 layer's (anything with `dequantized(dtype)`) dequantised to `dtype` (only the experts a step picks)."""

    def __init__(self, linears: list[nn.Module], dtype: torch.dtype) -> None:
        self.linears = linears
        self.dtype = dtype

    def __len__(self) -> int:
        return len(self.linears)

    def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]
        linear = self.linears[index]
        dequantized = getattr(linear, "dequantized", None)
        return linear.weight if dequantized is None else dequantized(self.dtype)


def _sequence_rows(batch: ForwardBatch, meta: ReferenceMetadata) -> list[tuple[int, slice]]:
    """(sequence, its rows) of every sequence the recurrent ops process alone (all but `state_decode`)."""
    batched = set() if meta.state_decode is None else set(meta.state_decode.seq_ids)
    return [
        (i, slice(start, start + query_len))
        for i, (start, query_len) in enumerate(zip(meta.seq_starts, batch.query_lens_cpu, strict=True))
        if i not in batched
    ]


def scan_sequences(
    batch: ForwardBatch, ssm_layer: torch.Tensor, out: torch.Tensor, decode: DecodeRows | None, *,
    scan: Callable[[slice, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]],
    states_after: Callable[[slice, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    step: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """A recurrent scan of a varlen batch on torch kernels of one family (Mamba2's, Mamba1's), for either backend
    (no host sync: the state rows are indexed with `batch.state_slots` on the device, the rows found from the host
    lengths). Each sequence not in `decode` runs alone: `scan(rows, initial state or None for a fresh one)` ->
    (y, final state), or, a verify row (`batch.draft_slots_cpu`), `states_after(rows, initial)` -> (y, the state
    after each position), the state after each of its first n positions kept in its draft rows; the sequences of
    `decode` (one token each, continuing a state) run together, `step(their rows, their states)` -> (y, states).
    Outputs go to `out` [T, ...] (returned), final states to each sequence's slot in the pool's dtype."""
    batched = set() if decode is None else set(decode.seq_ids)
    start = 0
    for i, (query_len, context_len) in enumerate(zip(batch.query_lens_cpu, batch.context_lens_cpu, strict=True)):
        rows, start = slice(start, start + query_len), start + query_len
        if i in batched:
            continue
        slot = batch.state_slots[i : i + 1]
        initial = None if query_len == context_len else ssm_layer.index_select(0, slot)[0]
        drafts = batch.draft_slots_cpu[i] if batch.draft_slots_cpu else ()
        if drafts:  # a verify row: one position at a time, keeping each position's state
            initial = torch.zeros_like(ssm_layer[0]) if initial is None else initial
            out[rows], states = states_after(rows, initial)
            ssm_layer[list(drafts)] = states[: len(drafts)].to(ssm_layer.dtype)
            final = states[-1]
        else:
            out[rows], final = scan(rows, initial)
        ssm_layer.index_copy_(0, slot, final[None].to(ssm_layer.dtype))
    if decode is not None:
        out[decode.rows], state = step(decode.rows, ssm_layer[decode.slots])
        ssm_layer.index_copy_(0, decode.slots, state.to(ssm_layer.dtype))
    return out


def per_channel_delta_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ssm_layer: torch.Tensor,
    batch: ForwardBatch,
) -> torch.Tensor:
    """`gated_delta_rule` with a per-channel g [T, Hv, Dk] (Kimi Delta Attention) on the torch reference, for a
    backend whose kernels take a per-head g only (CUDA): each sequence alone from the host lengths
    (`scan_sequences`); a step of decode rows only, every row in one torch step, fresh rows (context_len 1)
    starting from zeros, read on the device (no host sync)."""
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    if all(n == 1 for n in batch.query_lens_cpu) and batch.draft_rows is None:
        slots = batch.state_slots[: len(batch.query_lens_cpu)]
        states = ssm_layer[slots] * (batch.context_lens[: len(slots)] > 1)[:, None, None, None]
        out, state = delta_ref.gated_delta_rule_step(q, k, v, g, beta, states)
        ssm_layer.index_copy_(0, slots, state.to(ssm_layer.dtype))
        return out

    def scan(rows: slice, initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        rule = delta_ref.recurrent_gated_delta_rule if rows.stop - rows.start == 1 else delta_ref.chunk_gated_delta_rule
        return rule(q[rows], k[rows], v[rows], g[rows], beta[rows], initial)

    def states_after(rows: slice, initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return delta_ref.gated_delta_rule_verify(q[rows], k[rows], v[rows], g[rows], beta[rows], initial)

    def step(rows: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return delta_ref.gated_delta_rule_step(q[rows], k[rows], v[rows], g[rows], beta[rows], states)

    return scan_sequences(batch, ssm_layer, out, None, scan=scan, states_after=states_after, step=step)


def mamba2_scan(
    x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, A_log: torch.Tensor,  # noqa: N803
    dt_bias: torch.Tensor, D: torch.Tensor, ssm_layer: torch.Tensor, batch: ForwardBatch, *,  # noqa: N803
    dt_limit: tuple[float, float], decode: DecodeRows | None,
) -> torch.Tensor:
    """`KernelBackend.ssd_scan` on the torch reference kernels, for either backend (`scan_sequences`): the sequences
    of `decode` through `ssd_step`, every other one alone through `ssd_chunk_scan` (a verify row token by token
    through `ssd_states_after`)."""
    A = -torch.exp(A_log.float())  # noqa: N806
    dt = mamba2_ref.discretized_dt(dt, dt_bias, dt_limit)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return scan_sequences(
        batch, ssm_layer, out, decode,
        scan=lambda rows, state: mamba2_ref.ssd_chunk_scan(x[rows], dt[rows], A, B[rows], C[rows], D, state),
        states_after=lambda rows, state: mamba2_ref.ssd_states_after(x[rows], dt[rows], A, B[rows], C[rows], D,
                                                                     state),
        step=lambda rows, state: mamba2_ref.ssd_step(x[rows], dt[rows], A, B[rows], C[rows], D, state),
    )


def mamba1_scan(
    x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, A_log: torch.Tensor,  # noqa: N803
    dt_bias: torch.Tensor, D: torch.Tensor, z: torch.Tensor | None, ssm_layer: torch.Tensor,  # noqa: N803
    batch: ForwardBatch, *, decode: DecodeRows | None,
) -> torch.Tensor:
    """`KernelBackend.selective_scan` on the torch reference kernels, for either backend (`scan_sequences`): the
    sequences of `decode` through `selective_step`, every other one alone through `selective_scan` (a verify row
    token by token through `selective_states_after`)."""
    A = -torch.exp(A_log.float())  # noqa: N806
    dt = mamba2_ref.discretized_dt(dt, dt_bias, (0.0, float("inf")))

    def gate(rows: slice | torch.Tensor) -> torch.Tensor | None:
        return None if z is None else z[rows]

    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return scan_sequences(
        batch, ssm_layer, out, decode,
        scan=lambda rows, state: mamba1_ref.selective_scan(x[rows], dt[rows], A, B[rows], C[rows], D, gate(rows),
                                                           state),
        states_after=lambda rows, state: mamba1_ref.selective_states_after(x[rows], dt[rows], A, B[rows], C[rows], D,
                                                                           gate(rows), state),
        step=lambda rows, state: mamba1_ref.selective_step(x[rows], dt[rows], A, B[rows], C[rows], D, gate(rows),
                                                           state),
    )


def get_backend(device: torch.device | str, *, attention: str | None = None) -> KernelBackend:
    """The backend for `device`, chosen once by the runner: `CudaBackend` on CUDA devices when Triton and
    flash-linear-attention are installed (`hybridcache-llm[cuda]`), the reference backend everywhere else.
    `attention`: the attention backend's registered name (`hybridcache.kernels.registry.ATTENTION`; None: "triton"
    with `CudaBackend`, else "reference"); ValueError for a name not registered or not for this device. The CUDA
    module is imported only here, so CPU runs never import Triton or fla."""
    device_type = torch.device(device).type
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is not None and importlib.util.find_spec("fla") is not None:
            from hybridcache.kernels.cuda_backend import CudaBackend

            return CudaBackend(ATTENTION.create(attention or "triton", device_type))
        warnings.warn(
            "CUDA device without triton and flash-linear-attention (pip install 'hybridcache-llm[cuda]'): "
            "running the torch reference kernels", stacklevel=2
        )
    return ReferenceBackend(ATTENTION.create(attention or "reference", device_type))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format,
               bias: torch.Tensor | None = None, gemm: str | None = None) -> torch.Tensor:
    """The GEMM of an FP8 linear layer (`layers/linear.py`): x [..., K] -> x W^T (+ bias) [..., N] in x's dtype,
    weight [N, K] float8_e4m3fn, scale in `fmt`'s shape, by the GEMM backend registered as `gemm`
    (`kernels.registry.GEMM`; None: "triton" on CUDA, "reference" elsewhere)."""
    return gemm_backend(gemm, x.device.type).linear(x, weight, scale, fmt, bias)


def fp8_linear_quantized(x: torch.Tensor, xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                         scale: torch.Tensor, fmt: Fp8Format, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_linear` of x [T, K] (bf16 / fp16 on CUDA, block format) by the "triton" backend's kernels on x already
    quantised (`add_rms_norm_fp8` / `gated_rms_norm_fp8`: xq, x_scale), which then skip their quantisation launch
    (`triton_block_fp8.fp8_linear(..., quantized=...)`; the same product)."""
    from hybridcache.kernels.gemm.triton_block_fp8 import fp8_linear as triton_fp8_linear

    return triton_fp8_linear(x, weight, scale, fmt, bias, quantized=(xq, x_scale))


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int,
                     pad_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_rms_norm` of x, residual [T, dim] and its output's FP8 quantisation per token per `group` channels for
    the FP8 linear after it: (sum, normed, xq [T', dim], scale [T', ceil(dim/group)] column-major), T' = T rounded up
    to `pad_rows` (`kernels/norm/fp8.py`: one launch on CUDA)."""
    from hybridcache.kernels.norm import fp8 as norm_fp8

    return norm_fp8.add_rms_norm_fp8(x, residual, weight, eps, group, pad_rows)


def gated_rms_norm_fp8(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group: int,
                       pad_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gated_rms_norm` of x, gate [T, heads, dim] flattened to [T, heads * dim], and its FP8 quantisation as
    `add_rms_norm_fp8`'s (`kernels/norm/fp8.py`: one launch on CUDA)."""
    from hybridcache.kernels.norm import fp8 as norm_fp8

    return norm_fp8.gated_rms_norm_fp8(x, gate, weight, eps, group, pad_rows)


def add_shared(routed: torch.Tensor, shared: tuple[torch.Tensor | None, torch.Tensor | Pending] | None,
               sigmoid_gate_add: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`moe`'s shared term added to the routed experts' output in its own launch: none, `sigmoid_gate_add(routed,
    gate, shared)` (the backend's op), or with gate None `routed + shared`; a pending shared output joined here."""
    if shared is None:
        return routed
    gate, out = shared[0], joined(shared[1])
    return routed + out if gate is None else sigmoid_gate_add(routed, gate, out)


def fork(stream: torch.cuda.Stream | None, fn: Callable[..., torch.Tensor], *args: object) -> Pending:
    """`fn(*args)` on `stream` (a backend's `side_stream`) after the current stream's work so far, or inline when
    None: `kernels/streams.py::fork`, for layers (they reach kernels through this module)."""
    return streams.fork(stream, fn, *args)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMM of a dense (unquantised) linear layer: x [..., K] -> x W^T (+ bias) [..., N], as `F.linear`; on
    CUDA in bf16 / fp16 at up to 64 rows, cuBLAS or the skinny Triton GEMM, whichever was measured faster for the
    shape (`kernels/gemm/dense.py`)."""
    return dense_gemm.linear(x, weight, bias)


def dense_swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`dense_linear(silu_mul(gate, up), weight, bias)` (an MLP's down projection; `silu_mul`: the backend's op),
    one launch where the skinny GEMM runs (`kernels/gemm/dense.py::swiglu_linear`)."""
    return dense_gemm.swiglu_linear(gate, up, weight, bias, silu_mul)


@functools.cache
def gemm_backend(name: str | None, device_type: str) -> GemmBackend:
    """The GEMM backend `name` for a device type (one instance each; None: the device's default). Importing
    `kernels.gemm` (this module does) registers them."""
    return GEMM.create(name or ("triton" if device_type == "cuda" else "reference"), device_type)


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 weight [N, K] with its scale as a dense matrix in `dtype` (`kernels/gemm/reference.py::dequantize`)."""
    from hybridcache.kernels.gemm.reference import dequantize

    return dequantize(weight, scale, fmt, dtype)


def fp8_quantize(weight: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight [N, K] -> (FP8 weight, scale in `fmt`'s shape) (`kernels/gemm/reference.py::quantize`)."""
    from hybridcache.kernels.gemm.reference import quantize

    return quantize(weight, fmt)


def fp8_requantize_rows(weight: torch.Tensor, scale: torch.Tensor,
                        block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked block-scaled weights [E, N, K] -> the same weights per output channel (FP8 weights, scales [E, N])
    (`kernels/gemm/reference.py::requantize_rows`)."""
    from hybridcache.kernels.gemm.reference import requantize_rows

    return requantize_rows(weight, scale, block)


def encoder_attention(name: str | None, device_type: str, dtype: torch.dtype, head_dim: int) -> EncoderAttention:
    """The vision tower's encoder attention backend `name` (`kernels.registry.ENCODER_ATTENTION`; None: the
    device's default, `encoder_attention.default_encoder_attention`) for heads of `head_dim` in `dtype`; ValueError
    when it is unknown, does not run on `device_type`, or names problems with the dtype or head dim."""
    name = name or default_encoder_attention(device_type, dtype, head_dim)
    backend = ENCODER_ATTENTION.create(name, device_type)
    problems = backend.problems(head_dim, dtype)
    if problems:
        raise ValueError(f"encoder attention {name!r} cannot run heads of {head_dim} in {dtype}: {'; '.join(problems)}")
    return backend
