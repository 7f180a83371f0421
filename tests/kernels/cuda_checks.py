"""Each CUDA kernel against the torch reference on random varlen batches: the cases, and the error of every
output and final state. Used by tests/kernels/test_cuda_kernels.py (which asserts tolerances) and
benchmarks/gpu_kernels.py (which prints the table). Imports the Triton kernels, so call it only where they run.

A case is a batch of sequences with new-token counts `lengths` and `history` tokens already cached before
them (0 = a fresh sequence: zero initial state; otherwise a random initial state / cached prefix, and for
attention a chunk that starts mid-page whenever history is not a multiple of the page size). State slots and
KV pages are shuffled so that no kernel can get away with identity indexing, and pool rows outside the batch
are checked to be left untouched.

Errors (`ErrorStats`): max_abs = max |out - ref|; max_rel = max_abs / max |ref|; norm_rel = ||out - ref|| /
||ref||. The reference runs in fp32 (it upcasts internally) on the same, already-rounded inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridcache.kernels.attention import reference as attention_ref
from hybridcache.kernels.conv import reference as conv_ref
from hybridcache.kernels.gated_delta import reference as delta_ref
from hybridcache.kernels.moe import reference as moe_ref

LENGTHS = (1, 17, 63, 64, 65, 200, 1500)
HISTORY = (0, 5, 100, 64, 0, 37, 130)


@dataclass(frozen=True)
class ErrorStats:
    max_abs: float
    max_rel: float
    norm_rel: float


def error_stats(out: torch.Tensor, ref: torch.Tensor) -> ErrorStats:
    """Errors of out against ref (both upcast to fp64); NaN anywhere gives inf errors."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return ErrorStats(float("inf"), float("inf"), float("inf"))
    diff = (out - ref).abs()
    max_abs = diff.max().item() if diff.numel() else 0.0
    return ErrorStats(
        max_abs=max_abs,
        max_rel=max_abs / max(ref.abs().max().item(), 1e-30),
        norm_rel=(diff.norm() / ref.norm().clamp_min(1e-30)).item(),
    )


@dataclass(frozen=True)
class VarlenBatch:
    cu_seqlens: torch.Tensor  # [S+1] int32
    context_lens: torch.Tensor  # [S] int32
    state_slots: torch.Tensor  # [S] int64, shuffled and distinct
    query_lens_cpu: tuple[int, ...]
    context_lens_cpu: tuple[int, ...]
    num_slots: int


def varlen_batch(lengths: Sequence[int], history: Sequence[int], device: torch.device, seed: int = 0) -> VarlenBatch:
    gen = torch.Generator().manual_seed(seed)
    num = len(lengths)
    num_slots = 2 * num + 1
    slots = torch.randperm(num_slots, generator=gen)[:num]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ctx = [h + q for h, q in zip(history, lengths, strict=True)]
    return VarlenBatch(
        cu_seqlens=cu.to(device),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        state_slots=slots.to(device),
        query_lens_cpu=tuple(lengths),
        context_lens_cpu=tuple(ctx),
        num_slots=num_slots,
    )


def _float(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.float()


def _untouched(pool_after: torch.Tensor, pool_before: torch.Tensor, slots: torch.Tensor) -> ErrorStats:
    keep = torch.ones(pool_before.shape[0], dtype=torch.bool, device=pool_before.device)
    keep[slots] = False
    return error_stats(pool_after[keep], pool_before[keep])


def _gdn_inputs(num_tokens: int, heads: tuple[int, int], dims: tuple[int, int], dtype: torch.dtype,
                device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    (hk, hv), (dk, dv) = heads, dims

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    q, k = rand(num_tokens, hk, dk).to(dtype), rand(num_tokens, hk, dk).to(dtype)
    v = rand(num_tokens, hv, dv).to(dtype)
    g = -F.softplus(rand(num_tokens, hv) - 1.0)  # fp32 log decay, as the layer computes it
    beta = rand(num_tokens, hv).sigmoid().to(dtype)
    return q, k, v, g, beta


def check_gated_delta(dtype: torch.dtype, device: torch.device, lengths: Sequence[int] = LENGTHS,
                      history: Sequence[int] = HISTORY, heads: tuple[int, int] = (2, 4),
                      dims: tuple[int, int] = (128, 128), seed: int = 0) -> dict[str, ErrorStats]:
    """fla's chunked rule (any lengths) and, when every length is 1, the in-place step kernel, via
    `gated_delta_rule_varlen`, against `gated_delta/reference.py` per sequence."""
    from hybridcache.kernels.gated_delta.fla import gated_delta_rule_varlen

    gen = torch.Generator().manual_seed(seed)
    batch = varlen_batch(lengths, history, device, seed)
    q, k, v, g, beta = _gdn_inputs(sum(lengths), heads, dims, dtype, device, gen)
    pool = (0.1 * torch.randn(batch.num_slots, heads[1], *dims, generator=gen)).to(device)
    before = pool.clone()
    out = gated_delta_rule_varlen(q, k, v, g, beta, pool, batch.state_slots, batch.cu_seqlens,
                                  batch.context_lens, batch.query_lens_cpu)
    ref_out = torch.empty_like(out, dtype=torch.float32)
    ref_states = []
    starts = batch.cu_seqlens.tolist()
    for i, (length, hist) in enumerate(zip(lengths, history, strict=True)):
        rows = slice(starts[i], starts[i] + length)
        initial = None if hist == 0 else before[batch.state_slots[i]]
        ref_out[rows], state = delta_ref.chunk_gated_delta_rule(
            q[rows].float(), k[rows].float(), v[rows].float(), g[rows], beta[rows].float(), initial
        )
        ref_states.append(state)
    return {
        "out": error_stats(out, ref_out),
        "final_state": error_stats(pool[batch.state_slots], torch.stack(ref_states)),
        "other_slots": _untouched(pool, before, batch.state_slots),
    }


def _conv_inputs(num_tokens: int, channels: int, kernel: int, dtype: torch.dtype, device: torch.device,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(num_tokens, channels, generator=gen).to(device, dtype)
    weight = (0.5 * torch.randn(channels, kernel, generator=gen)).to(device, dtype)
    bias = (0.1 * torch.randn(channels, generator=gen)).to(device, dtype)
    return x, weight, bias


def check_conv(dtype: torch.dtype, device: torch.device, lengths: Sequence[int] = LENGTHS,
               history: Sequence[int] = HISTORY, channels: int = 320, kernel: int = 4, with_bias: bool = True,
               seed: int = 0, activation: str | None = "silu") -> dict[str, ErrorStats]:
    """`causal_conv1d_varlen` against `conv/reference.py` per sequence (channels not a multiple of the
    kernel's channel block, to exercise its masks); `activation` None: LFM2's conv, without SiLU."""
    from hybridcache.kernels.conv.triton import causal_conv1d_varlen

    gen = torch.Generator().manual_seed(seed)
    batch = varlen_batch(lengths, history, device, seed)
    x, weight, bias = _conv_inputs(sum(lengths), channels, kernel, dtype, device, gen)
    bias = bias if with_bias else None
    pool = torch.randn(batch.num_slots, channels, kernel - 1, generator=gen).to(device, dtype)
    before = pool.clone()
    out = causal_conv1d_varlen(x, weight, bias, pool, batch.state_slots, batch.cu_seqlens, batch.context_lens,
                               batch.query_lens_cpu, activation=activation)
    ref_out, ref_states = torch.empty_like(out, dtype=torch.float32), []
    starts = batch.cu_seqlens.tolist()
    for i, (length, hist) in enumerate(zip(lengths, history, strict=True)):
        rows = slice(starts[i], starts[i] + length)
        initial = None if hist == 0 else before[batch.state_slots[i]].float()
        ref_out[rows], state = conv_ref.causal_conv1d(x[rows].float(), weight.float(), _float(bias), initial,
                                                      activation=activation)
        ref_states.append(state)
    return {
        "out": error_stats(out, ref_out),
        "final_state": error_stats(pool[batch.state_slots], torch.stack(ref_states)),
        "other_slots": _untouched(pool, before, batch.state_slots),
    }


def check_decode_step(dtype: torch.dtype, device: torch.device, context_lens: Sequence[int] = LENGTHS,
                      heads: tuple[int, int] = (2, 4), dims: tuple[int, int] = (128, 128), channels: int = 320,
                      kernel: int = 4, seed: int = 0, activation: str | None = "silu") -> dict[str, ErrorStats]:
    """The decode kernels (one token per sequence; context_len 1 = fresh): conv step (`activation` None: LFM2's,
    without SiLU) and gated delta step against the conv and gated delta references."""
    from hybridcache.kernels.conv.triton import causal_conv1d_decode
    from hybridcache.kernels.gated_delta.triton_step import gated_delta_rule_decode

    gen = torch.Generator().manual_seed(seed)
    num = len(context_lens)
    batch = varlen_batch([1] * num, [c - 1 for c in context_lens], device, seed)
    fresh = torch.tensor([c == 1 for c in context_lens], device=device)
    x, weight, bias = _conv_inputs(num, channels, kernel, dtype, device, gen)
    conv_pool = torch.randn(batch.num_slots, channels, kernel - 1, generator=gen).to(device, dtype)
    conv_before = conv_pool.clone()
    conv_out = causal_conv1d_decode(x, weight, bias, conv_pool, batch.state_slots, batch.context_lens,
                                    activation=activation)
    conv_init = conv_before[batch.state_slots].masked_fill(fresh[:, None, None], 0)
    ref_conv, ref_conv_state = conv_ref.causal_conv1d_step(x.float(), weight.float(), bias.float(), conv_init.float(),
                                                           activation=activation)

    q, k, v, g, beta = _gdn_inputs(num, heads, dims, dtype, device, gen)
    ssm_pool = (0.1 * torch.randn(batch.num_slots, heads[1], *dims, generator=gen)).to(device)
    ssm_before = ssm_pool.clone()
    out = gated_delta_rule_decode(q, k, v, g, beta, ssm_pool, batch.state_slots, batch.context_lens)
    ssm_init = ssm_before[batch.state_slots].masked_fill(fresh[:, None, None, None], 0)
    ref_out, ref_state = delta_ref.gated_delta_rule_step(q.float(), k.float(), v.float(), g, beta.float(), ssm_init)
    return {
        "conv_out": error_stats(conv_out, ref_conv),
        "conv_state": error_stats(conv_pool[batch.state_slots], ref_conv_state),
        "conv_other_slots": _untouched(conv_pool, conv_before, batch.state_slots),
        "gdn_out": error_stats(out, ref_out),
        "gdn_state": error_stats(ssm_pool[batch.state_slots], ref_state),
        "gdn_other_slots": _untouched(ssm_pool, ssm_before, batch.state_slots),
    }


def check_gated_conv_step(dtype: torch.dtype, device: torch.device, context_lens: Sequence[int] = LENGTHS,
                          channels: int = 320, kernel: int = 3, seed: int = 0) -> dict[str, ErrorStats]:
    """The decode conv with LFM2's gates inside its launch (`gates=(b, c)`, b, c and x column views of one [N, 3C]
    projection) against torch's `c * conv(b * x)` around the ungated launch, from the same pool: the outputs and
    the states it writes (b * x) should agree bit for bit."""
    from hybridcache.kernels.conv.triton import causal_conv1d_decode

    gen = torch.Generator().manual_seed(seed)
    num = len(context_lens)
    batch = varlen_batch([1] * num, [c - 1 for c in context_lens], device, seed)
    projected, weight, bias = _conv_inputs(num, 3 * channels, kernel, dtype, device, gen)
    b, c, x = projected.chunk(3, dim=-1)
    weight, bias = weight[:channels].contiguous(), bias[:channels]
    pool = torch.randn(batch.num_slots, channels, kernel - 1, generator=gen).to(device, dtype)
    pool_unfused = pool.clone()
    fused = causal_conv1d_decode(x, weight, bias, pool, batch.state_slots, batch.context_lens, activation=None,
                                 gates=(b, c))
    unfused = c * causal_conv1d_decode(b * x, weight, bias, pool_unfused, batch.state_slots, batch.context_lens,
                                       activation=None)
    return {"out": error_stats(fused, unfused), "pool": error_stats(pool, pool_unfused)}


@dataclass(frozen=True)
class PagedKV:
    kv_pool: torch.Tensor  # [2, num_pages, page, Hkv, D]
    block_tables: torch.Tensor  # [S, P] int32, shuffled pages, padded with 0
    kv_rows: torch.Tensor  # [T] int64 rows of the new tokens


def paged_kv(batch: VarlenBatch, page: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
             device: torch.device, gen: torch.Generator) -> PagedKV:
    """A pool with random history K/V already in place, pages handed out in shuffled order; every slot outside
    the contexts holds NaN."""
    pages_per_seq = [-(-c // page) for c in batch.context_lens_cpu]
    num_pages = sum(pages_per_seq) + 3
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # page 0 is never handed out
    table = torch.zeros(len(pages_per_seq), max(pages_per_seq), dtype=torch.int32)
    rows, covered = [], []
    for i, (count, ctx, qlen) in enumerate(zip(pages_per_seq, batch.context_lens_cpu, batch.query_lens_cpu,
                                               strict=True)):
        table[i, :count] = torch.tensor(order[:count])
        order = order[count:]
        rows += [int(table[i, p // page]) * page + p % page for p in range(ctx - qlen, ctx)]
        covered += [int(table[i, p // page]) * page + p % page for p in range(ctx)]
    kv_pool = torch.randn(2, num_pages, page, kv_heads, head_dim, generator=gen)
    # the slots no context covers (past a context, unused and padding pages) hold NaN, as a recycled page can
    # (a freed checkpoint's state bytes read as KV): no kernel may let them reach its output
    stale = torch.ones(num_pages * page, dtype=torch.bool)
    stale[covered] = False
    kv_pool.view(2, num_pages * page, -1)[:, stale] = float("nan")
    kv_pool = kv_pool.to(device, dtype)
    return PagedKV(kv_pool, table.to(device), torch.tensor(rows, dtype=torch.int64, device=device))


def check_attention(dtype: torch.dtype, device: torch.device, lengths: Sequence[int] = LENGTHS,
                    history: Sequence[int] = HISTORY, page: int = 16, heads: tuple[int, int] = (8, 2),
                    head_dim: int = 128, seed: int = 0, num_splits: int = 1) -> dict[str, ErrorStats]:
    """`write_kv` + `paged_attention` (prefill kernel, its keys in `num_splits` splits, or decode kernel when
    every length is 1) against the reference pair on the same pool."""
    from hybridcache.kernels.attention.triton_paged import paged_attention, write_kv

    gen = torch.Generator().manual_seed(seed)
    batch = varlen_batch(lengths, history, device, seed)
    num_q, num_kv = heads
    kv = paged_kv(batch, page, num_kv, head_dim, dtype, device, gen)
    num_tokens = sum(lengths)
    q = torch.randn(num_tokens, num_q, head_dim, generator=gen).to(device, dtype)
    keys = torch.randn(num_tokens, num_kv, head_dim, generator=gen).to(device, dtype)
    values = torch.randn(num_tokens, num_kv, head_dim, generator=gen).to(device, dtype)
    ref_pool = kv.kv_pool.clone()
    attention_ref.write_kv(ref_pool, keys, values, kv.kv_rows)
    write_kv(kv.kv_pool, keys, values, kv.kv_rows)
    scale = head_dim**-0.5
    out = paged_attention(q, kv.kv_pool, kv.block_tables, batch.cu_seqlens, batch.context_lens,
                          batch.query_lens_cpu, batch.context_lens_cpu, scale=scale, num_splits=num_splits)
    # The reference's softmax probabilities are rounded to q's dtype before P @ V; upcast for an fp32 oracle.
    ref = attention_ref.paged_attention(q.float(), ref_pool.float(), kv.block_tables, batch.cu_seqlens,
                                    batch.query_lens_cpu, batch.context_lens_cpu, scale=scale)
    # (the stale slots compare as 0 = 0 where both left them NaN; a write into one shows)
    return {"kv_write": error_stats(kv.kv_pool.nan_to_num(0.0), ref_pool.nan_to_num(0.0)),
            "out": error_stats(out, ref)}


def routing(num_tokens: int, experts: int, top_k: int, dtype: torch.dtype, device: torch.device,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing as the layer makes it: distinct experts per token, weights summing to 1."""
    ids = torch.rand(num_tokens, experts, generator=gen).argsort(dim=-1)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    return (weights / weights.sum(-1, keepdim=True)).to(device, dtype), ids.to(device)


def check_moe(dtype: torch.dtype, device: torch.device, num_tokens: int = 300, hidden: int = 256,
              experts: int = 8, top_k: int = 2, intermediate: int = 128, seed: int = 0,
              block_m: int | None = None) -> dict[str, ErrorStats]:
    """The routed experts (`moe/grouped.py`: sort, each sorted row's expert output by the grouped GEMM when
    `block_m` is None, else by the Triton expert GEMM with that tile, then the combine) against
    `moe/reference.py::routed_experts` on the same routing; the reference runs in fp32 on the same rounded
    weights. Experts with no rows and runs longer than one tile both occur at the default sizes."""
    from hybridcache.kernels.moe.grouped import (
        ExpertWeights,
        expert_rows_grouped,
        expert_rows_triton,
        pair_rows,
        sort_pairs,
    )
    from hybridcache.kernels.moe.triton_experts import combine

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    gate, up = (torch.randn(experts, intermediate, hidden, generator=gen).to(device, dtype) / hidden**0.5
                for _ in range(2))
    down = torch.randn(experts, hidden, intermediate, generator=gen).to(device, dtype) / intermediate**0.5
    weights, ids = routing(num_tokens, experts, top_k, dtype, device, gen)
    ids = ids.masked_fill(ids == experts - 1, 0)  # the last expert gets no row (a token may pick 0 twice: a valid sum)
    stacked = ExpertWeights.stack(list(gate), list(up), list(down))
    order, counts = sort_pairs(ids, experts)
    if block_m is None:
        pos = pair_rows(order)
        out = combine(expert_rows_grouped(x, pos, counts.cumsum(0, dtype=torch.int32), top_k, stacked), weights, pos)
    else:
        out = combine(expert_rows_triton(x, order, counts, top_k, stacked, block_m), weights)
    ref = moe_ref.routed_experts(x.float(), weights.float(), ids, list(gate.float()), list(up.float()),
                                 list(down.float()))
    return {"out": error_stats(out, ref)}


def host_syncs(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
    """Run every kernel entry point once to warm up (compilation, autotuning), then again under
    `torch.cuda.set_sync_debug_mode("error")`; name -> "ok", or the error of the first host sync it hit."""
    from hybridcache.kernels.attention.triton_paged import paged_attention, write_kv
    from hybridcache.kernels.conv.triton import causal_conv1d_decode, causal_conv1d_varlen
    from hybridcache.kernels.gated_delta.fla import gated_delta_rule_varlen
    from hybridcache.kernels.moe.grouped import ExpertWeights, grouped_experts

    gen = torch.Generator().manual_seed(0)
    prefill = varlen_batch((1, 17, 65, 200), (0, 5, 64, 37), device)
    decode = varlen_batch((1,) * 4, (0, 5, 64, 37), device)
    calls = {}
    for label, batch in (("prefill", prefill), ("decode", decode)):
        tokens = sum(batch.query_lens_cpu)
        q, k, v, g, beta = _gdn_inputs(tokens, (2, 4), (128, 128), dtype, device, gen)
        ssm = torch.zeros(batch.num_slots, 4, 128, 128, device=device)
        calls[f"gated_delta {label}"] = lambda b=batch, q=q, k=k, v=v, g=g, beta=beta, ssm=ssm: (
            gated_delta_rule_varlen(q, k, v, g, beta, ssm, b.state_slots, b.cu_seqlens, b.context_lens,
                                    b.query_lens_cpu))
        x, weight, bias = _conv_inputs(tokens, 320, 4, dtype, device, gen)
        conv = torch.zeros(batch.num_slots, 320, 3, device=device, dtype=dtype)
        calls[f"conv {label}"] = (
            (lambda b=batch, x=x, w=weight, bias=bias, conv=conv: causal_conv1d_varlen(
                x, w, bias, conv, b.state_slots, b.cu_seqlens, b.context_lens, b.query_lens_cpu))
            if label == "prefill" else
            (lambda b=batch, x=x, w=weight, bias=bias, conv=conv: causal_conv1d_decode(
                x, w, bias, conv, b.state_slots, b.context_lens)))
        kv = paged_kv(batch, 16, 2, 128, dtype, device, gen)
        qa = torch.randn(tokens, 8, 128, generator=gen).to(device, dtype)
        keys = torch.randn(tokens, 2, 128, generator=gen).to(device, dtype)

        def attend(b=batch, kv=kv, qa=qa, keys=keys) -> None:
            write_kv(kv.kv_pool, keys, keys, kv.kv_rows)
            paged_attention(qa, kv.kv_pool, kv.block_tables, b.cu_seqlens, b.context_lens, b.query_lens_cpu,
                            b.context_lens_cpu, scale=0.1)

        calls[f"attention {label}"] = attend
        experts = ExpertWeights(torch.randn(8, 256, 128, generator=gen).to(device, dtype),
                                torch.randn(8, 128, 128, generator=gen).to(device, dtype))
        xm = torch.randn(tokens, 128, generator=gen).to(device, dtype)
        weights, ids = routing(tokens, 8, 2, dtype, device, gen)
        calls[f"moe {label}"] = lambda xm=xm, weights=weights, ids=ids, experts=experts: grouped_experts(
            xm, weights, ids, experts)
    report = {}
    for name, call in calls.items():
        call()
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
            report[name] = "ok"
        except RuntimeError as exc:
            report[name] = str(exc).splitlines()[0][:200]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return report


def check_norms(dtype: torch.dtype, device: torch.device, rows: int = 300, seed: int = 0) -> dict[str, ErrorStats]:
    """The fused norms against `kernels.norm.reference` (and the delta rule's l2norm, in fp32) with random weights:
    hidden-size rows (2048), head rows (128, the DeltaNet gated norm and q/k norms) and rows narrower than their
    padded block (80), on non-contiguous inputs as the layers pass them: a row slice, and [T, H, D] head views of
    a fused projection."""
    from hybridcache.kernels.gated_delta import reference as delta_reference
    from hybridcache.kernels.norm import reference
    from hybridcache.kernels.norm.triton import gated_rms_norm, l2norm, rms_norm

    gen = torch.Generator().manual_seed(seed)
    stats = {}
    for dim in (2048, 80, 128):  # 80: a padded block (128) wider than the row; 128 last (its weights serve below)
        plain = (0.1 * torch.randn(dim, generator=gen)).to(device, dtype)
        gated = (1 + 0.1 * torch.randn(dim, generator=gen)).to(device, dtype)
        x = (3 * torch.randn(rows, 2, dim, generator=gen)).to(device, dtype)[:, 0]  # row stride 2 * dim
        gate = torch.randn(rows, dim, generator=gen).to(device, dtype)
        stats[f"rms_norm d{dim}"] = error_stats(rms_norm(x, plain, 1e-6), reference.rms_norm(x, plain, 1e-6))
        stats[f"gated_rms_norm d{dim}"] = error_stats(gated_rms_norm(x, gate, gated, 1e-6),
                                                      reference.gated_rms_norm(x, gate, gated, 1e-6))
    # Head views read in place: q / k / z sliced out of a fused projection row ([T, H, 128], row stride 3 * H * 128).
    heads, dim = 4, 128
    fused = (3 * torch.randn(rows, 3 * heads * dim, generator=gen)).to(device, dtype)
    q = fused[:, :heads * dim].view(rows, heads, dim)
    z = fused[:, heads * dim:2 * heads * dim].view(rows, heads, dim)
    core = torch.randn(rows, heads, dim, generator=gen).to(device, dtype)
    stats["rms_norm heads"] = error_stats(rms_norm(q, plain, 1e-6), reference.rms_norm(q, plain, 1e-6))
    stats["gated_rms_norm heads"] = error_stats(gated_rms_norm(core, z, gated, 1e-6),
                                                reference.gated_rms_norm(core, z, gated, 1e-6))
    stats["l2norm heads"] = error_stats(l2norm(q), delta_reference.l2norm(q.float()).to(dtype))
    stats["l2norm d2048"] = error_stats(l2norm(x), delta_reference.l2norm(x.float()).to(dtype))
    return stats


def check_rotary(dtype: torch.dtype, device: torch.device, rows: int = 300, heads: tuple[int, int] = (16, 2),
                 head_dim: int = 256, rotary_dim: int = 64, seed: int = 0) -> dict[str, ErrorStats]:
    """The Triton partial rotary against `kernels.rotary.reference`, on query/key views of one wider projection
    (strided over tokens and heads, as the layers pass them) and the cos/sin table of real positions."""
    from hybridcache.kernels.rotary import reference
    from hybridcache.kernels.rotary.triton import rotary
    from hybridcache.layers.rotary import rotary_cos_sin

    gen = torch.Generator().manual_seed(seed)
    q_heads, k_heads = heads
    mixed = torch.randn(rows, (2 * q_heads + k_heads) * head_dim, generator=gen).to(device, dtype)
    query = mixed[:, : 2 * q_heads * head_dim].view(rows, q_heads, 2 * head_dim)[..., :head_dim]
    key = mixed[:, 2 * q_heads * head_dim:].view(rows, k_heads, head_dim)
    positions = torch.randint(0, 40000, (rows,), generator=gen).to(device)
    cos, sin = rotary_cos_sin(positions, rotary_dim, 10000000.0, dtype)
    out_q, out_k = rotary(query, key, cos, sin)
    ref_q, ref_k = reference.rotary(query.float(), key.float(), cos.float(), sin.float())
    return {"query": error_stats(out_q, ref_q), "key": error_stats(out_k, ref_k),
            "pass_through": error_stats(out_q[..., rotary_dim:], query[..., rotary_dim:])}


def check_delta_gates(dtype: torch.dtype, device: torch.device, rows: int = 300, heads: int = 32,
                      seed: int = 0) -> dict[str, ErrorStats]:
    """The fused DeltaNet gates against `gated_delta/reference.delta_gates`, on strided a, b (slices of one
    [T, 2 * heads] projection, as Qwen3-Next's in_proj_ba gives them), with a spread over softplus's regimes
    (a + dt_bias from -30 to 30: the log1p tail, the middle, the x > 20 identity)."""
    from hybridcache.kernels.gated_delta import reference
    from hybridcache.kernels.gated_delta.triton_gates import delta_gates

    gen = torch.Generator().manual_seed(seed)
    ba = (torch.linspace(-30, 30, rows * 2 * heads).reshape(rows, 2 * heads)[torch.randperm(rows, generator=gen)]
          + torch.randn(rows, 2 * heads, generator=gen)).to(device, dtype)
    b, a = ba[:, :heads], ba[:, heads:]
    a_log = torch.empty(heads).uniform_(0.05, 1.0, generator=gen).log().to(device, dtype)
    dt_bias = torch.empty(heads).uniform_(-1, 1, generator=gen).to(device, dtype)
    g, beta = delta_gates(a, b, a_log, dt_bias)
    g_ref, beta_ref = reference.delta_gates(a, b, a_log, dt_bias)
    return {"g": error_stats(g, g_ref), "beta": error_stats(beta, beta_ref)}


def check_route(dtype: torch.dtype, device: torch.device, rows: int = 300, seed: int = 0,
                launch: tuple[int, int] | None = None) -> dict[str, ErrorStats]:
    """The fused top-k routing against `moe/reference.route` for the shapes of the models (16 experts top 4,
    512 experts top 10, 32 top 8 without renormalising), on strided logits: the weights' errors, and how many
    picks differ ("ids": max_abs counts them; a pick of an expert tied in probability with the reference's, as
    bf16 logits often are among 512, counts as the same pick). `launch`: (rows per program, warps), else the
    engine's (`triton_route.launch_rows`: one row a program up to 1,024 rows or from 128 experts, else 16)."""
    from hybridcache.kernels.moe.triton_route import route

    gen = torch.Generator().manual_seed(seed)
    stats = {}
    for experts, top_k, renormalize in ((16, 4, True), (512, 10, True), (32, 8, False)):
        logits = (2 * torch.randn(rows, 2 * experts, generator=gen)).to(device, dtype)[:, :experts]
        weights, ids = route(logits, top_k, renormalize, *(launch or ()))
        ref_weights, ref_ids = moe_ref.route(logits, top_k, renormalize)
        stats[f"weights E{experts}k{top_k}"] = error_stats(weights, ref_weights)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # a pick differs unless it is an equal-prob tie
        misses = (probs.gather(1, ids) != probs.gather(1, ref_ids)).sum().float()
        stats[f"ids E{experts}k{top_k}"] = ErrorStats(max_abs=misses.item(), max_rel=misses.item(),
                                                      norm_rel=misses.item())
    return stats


def check_route_sigmoid(device: torch.device, rows: int = 300, seed: int = 0) -> dict[str, ErrorStats]:
    """The one-group sigmoid routing (`triton_route.route_sigmoid`) against `moe/reference.route_sigmoid` at the
    routers' shapes (Nemotron 3 Nano's 128 experts top-6 renormalised x 2.5, Kimi Linear's 256 top-8 renormalised
    x 2.446, LFM2-8B-A1B's 32 top-4 renormalised with eps 1e-6, and one not renormalised), a bias of the size of
    the scores, fp32 logits as a strided view: the weights' errors (each row's picks compared as a set, by expert
    id), and how many picks differ ("ids"; a pick whose p + bias ties the reference's counts as the same)."""
    from hybridcache.kernels.moe.triton_route import route_sigmoid

    gen = torch.Generator().manual_seed(seed)
    stats = {}
    for experts, top_k, renormalize, eps, scale in ((128, 6, True, 1e-20, 2.5), (256, 8, True, 1e-20, 2.446),
                                                    (32, 4, True, 1e-6, 1.0), (16, 4, False, 1e-20, 1.0)):
        logits = (2 * torch.randn(rows, 2 * experts, generator=gen)).to(device)[:, :experts]
        bias = (0.5 * torch.randn(experts, generator=gen)).to(device)
        weights, ids = route_sigmoid(logits, bias, top_k, renormalize, eps, scale)
        ref_weights, ref_ids = moe_ref.route_sigmoid(logits, bias, top_k, renormalize, eps, scale)
        order, ref_order = ids.argsort(dim=-1), ref_ids.argsort(dim=-1)
        stats[f"weights E{experts}k{top_k}"] = error_stats(weights.gather(1, order), ref_weights.gather(1, ref_order))
        choice = torch.sigmoid(logits) + bias
        picked = choice.gather(1, ids).sort(dim=-1)[0]
        misses = (picked != choice.gather(1, ref_ids).sort(dim=-1)[0]).sum().float()
        stats[f"ids E{experts}k{top_k}"] = ErrorStats(max_abs=misses.item(), max_rel=misses.item(),
                                                      norm_rel=misses.item())
    logits = torch.randn(3, 16, generator=gen).to(device)
    logits[1, 5] = float("nan")  # a diverged token: distinct experts in range, NaN weights; its neighbours routed
    weights, ids = route_sigmoid(logits, torch.zeros(16, device=device), 4, True, 1e-20, 1.0)
    assert ids.min() >= 0 and ids.max() < 16 and len(set(ids[1].tolist())) == 4 and weights[1].isnan().all(), ids
    want = moe_ref.route_sigmoid(logits[[0, 2]], torch.zeros(16, device=device), 4, True, 1e-20, 1.0)[1]
    assert torch.equal(ids[[0, 2]].sort(dim=-1)[0], want.sort(dim=-1)[0]), (ids, want)
    return stats


def check_route_of_bad_rows(dtype: torch.dtype, device: torch.device) -> None:
    """Rows of NaN or inf logits (a diverged token) route to distinct experts in range, as torch.topk's picks, with
    NaN weights, and leave the other rows' routing as the reference's (the pair sort indexes its counts with the
    ids: an id out of range broke it, or put the token's pairs in the shared expert's run)."""
    from hybridcache.kernels.moe.triton_route import route

    for experts, top_k in ((8, 2), (16, 4), (12, 3)):
        logits = torch.randn(6, experts, generator=torch.Generator().manual_seed(experts)).to(device, dtype)
        logits[1, 3] = float("nan")
        logits[3, 0] = float("inf")
        logits[4] = float("nan")
        logits[5, 2] = float("-inf")  # one expert ruled out: an ordinary row
        weights, ids = route(logits, top_k, True)
        assert ids.min() >= 0 and ids.max() < experts, ids
        for row in (1, 3, 4):
            assert len(set(ids[row].tolist())) == top_k and weights[row].isnan().all(), (row, ids[row], weights[row])
        good = [0, 2, 5]
        ref_weights, ref_ids = moe_ref.route(logits[good], top_k, True)
        assert torch.equal(ids[good], ref_ids) and torch.allclose(weights[good].float(), ref_weights.float(),
                                                                 rtol=1e-2, atol=1e-3)


def check_sort_pairs(device: torch.device, seed: int = 0) -> dict[str, int]:
    """The one-launch pair sort (`triton_sort.sort_pairs_triton`) against torch's stable argsort and bincount, for
    the models' routings (16 experts top 4, 32 top 8, 512 top 10), a token that picks one expert twice, one pair,
    and `MAX_PAIRS` pairs, and with `shared` (an FP8 stack's shared expert as every token's last pick: "+s", the
    reference sorting the [T, k + 1] ids): how many order entries and counts differ, per case (0 everywhere when
    exact)."""
    from hybridcache.kernels.moe.triton_sort import MAX_PAIRS, sort_pairs_triton

    gen = torch.Generator().manual_seed(seed)
    cases = {"E16k4 T64": (64, 16, 4), "E32k8 T64": (64, 32, 8), "E512k10 T37": (37, 512, 10), "E4k1 T1": (1, 4, 1),
             f"E32k8 T{MAX_PAIRS // 8}": (MAX_PAIRS // 8, 32, 8), "E32k8+s T64": (64, 32, 8),
             "E512k10+s T37": (37, 512, 10), "E4k1+s T1": (1, 4, 1), "E16k4+s T3": (3, 16, 4),
             f"E32k8+s T{MAX_PAIRS // 8}": (MAX_PAIRS // 8, 32, 8)}
    misses = {}
    for name, (tokens, experts, top_k) in cases.items():
        shared = "+s" in name
        ids = torch.rand(tokens, experts, generator=gen).argsort(dim=-1)[:, :top_k]
        if name.startswith("E16"):
            ids[::3, 1] = ids[::3, 0]  # a token picking one expert twice (a valid sum of two weights)
        order, counts = sort_pairs_triton(ids.to(device), experts + shared, shared)
        if shared:
            ids = torch.cat([ids, torch.full((tokens, 1), experts)], dim=1)
            experts += 1
        flat = ids.reshape(-1)
        ref_order = torch.argsort(flat, stable=True)
        ref_counts = torch.bincount(flat, minlength=experts).to(torch.int32)
        misses[name] = int((order.cpu() != ref_order).sum()) + int((counts.cpu() != ref_counts).sum())
    return misses


VERIFY_DRAFTS = (0, 1, 2, 3, 3, 0)  # drafts of each verify row (0: a plain decode row)
VERIFY_HISTORY = (150, 151, 200, 0, 163, 1)  # 0: a fresh row (its slot's old contents must be ignored)


def check_verify(dtype: torch.dtype, device: torch.device, *, states_only: bool,
                 state_dtype: torch.dtype = torch.float32,
                 drafts: Sequence[int] = VERIFY_DRAFTS, history: Sequence[int] = VERIFY_HISTORY,
                 heads: tuple[int, int] = (2, 4), dims: tuple[int, int] = (32, 64), channels: int = 200,
                 kernel: int = 4, seed: int = 0) -> dict[str, ErrorStats]:
    """The verify kernels (`gated_delta/triton_verify.py`, `conv/triton_verify.py`) against the references.

    Each sequence feeds 1 + drafts[i] tokens after `history[i]` tokens whose recurrent state is computed by the
    reference chunked rule from random inputs (so the state is a real one, not noise) and stored in the slot in
    `state_dtype`. With `states_only`, a prefill chunk of 70 tokens joins the batch (no drafts; fla's part in the
    backend, so only its untouched state rows are checked here). Reference: `gated_delta_rule_verify` and
    `conv_states_after` per sequence; draft row j of sequence i must hold the state after position j."""
    from hybridcache.kernels.conv.triton_verify import conv_draft_states
    from hybridcache.kernels.gated_delta.triton_verify import gated_delta_rule_verify

    gen = torch.Generator().manual_seed(seed)
    lengths = [1 + n for n in drafts]
    history = list(history)
    drafts = list(drafts)
    if states_only:
        lengths, history, drafts = lengths + [70], history + [30], drafts + [0]
    num, width = len(lengths), max(max(drafts), 1)
    batch = varlen_batch(lengths, history, device, seed)
    num_rows = batch.num_slots + num * width  # slots first, then `width` draft rows per sequence
    table = torch.arange(batch.num_slots, num_rows).view(num, width)
    q, k, v, g, beta = _gdn_inputs(sum(lengths), heads, dims, dtype, device, gen)
    ssm_pool = (0.1 * torch.randn(num_rows, heads[1], *dims, generator=gen)).to(device, state_dtype)
    x, _, _ = _conv_inputs(sum(lengths), channels, kernel, dtype, device, gen)
    conv_pool = torch.randn(num_rows, channels, kernel - 1, generator=gen).to(device, dtype)
    for i, hist in enumerate(history):  # a state after `hist` real tokens
        if hist:
            hq, hk, hv, hg, hb = _gdn_inputs(hist, heads, dims, torch.float32, torch.device("cpu"), gen)
            _, state = delta_ref.chunk_gated_delta_rule(hq, hk, hv, hg, hb)
            ssm_pool[batch.state_slots[i]] = state.to(device, state_dtype)
    ssm_before, conv_before = ssm_pool.clone(), conv_pool.clone()
    table_dev = table.to(device)
    num_drafts = torch.tensor(drafts, dtype=torch.int32, device=device)
    conv_draft_states(x, conv_pool, batch.state_slots, batch.cu_seqlens, batch.context_lens, table_dev, num_drafts)
    out = gated_delta_rule_verify(q, k, v, g, beta, ssm_pool, batch.state_slots, batch.cu_seqlens,
                                  batch.context_lens, table_dev, num_drafts, states_only=states_only)
    starts = batch.cu_seqlens.tolist()
    written, ref_ssm, got_ssm, ref_conv, got_conv, ref_out, got_out = [], [], [], [], [], [], []
    for i, (length, hist, n) in enumerate(zip(lengths, history, drafts, strict=True)):
        rows = slice(starts[i], starts[i] + length)
        slot = int(batch.state_slots[i])
        initial = ssm_before[slot] if hist else torch.zeros_like(ssm_before[slot])
        conv_initial = conv_before[slot] if hist else torch.zeros_like(conv_before[slot])
        if n:
            conv_after = conv_ref.conv_states_after(x[rows].float(), conv_initial.float())
            ref_conv.append(conv_after[:n])
            got_conv.append(conv_pool[table[i, :n]].float())
        if states_only and not n:
            continue  # fla's sequence: nothing of this kernel's
        ref, states = delta_ref.gated_delta_rule_verify(q[rows].float(), k[rows].float(), v[rows].float(), g[rows],
                                                        beta[rows].float(), initial)
        written += table[i, :n].tolist()
        ref_ssm.append(states[:n].float())
        got_ssm.append(ssm_pool[table[i, :n]].float())
        if not states_only:
            written.append(slot)
            ref_ssm.append(states[-1:].float())
            got_ssm.append(ssm_pool[slot:slot + 1].float())
            ref_out.append(ref)
            got_out.append(out[rows])
    stats = {
        "draft_states": error_stats(torch.cat(got_ssm), torch.cat(ref_ssm)),
        "conv_draft_states": error_stats(torch.cat(got_conv), torch.cat(ref_conv)),
        "other_rows": _untouched(ssm_pool, ssm_before, torch.tensor(written, dtype=torch.int64, device=device)),
        "conv_other_rows": _untouched(conv_pool, conv_before, table[table_dev.new_tensor(drafts)[:, None].cpu()
                                                                   > torch.arange(width)].to(device)),
    }
    if not states_only:
        stats["out"] = error_stats(torch.cat(got_out), torch.cat(ref_out))
    elif out is not None:
        raise AssertionError("states-only mode returned outputs")
    return stats


def _nan_padded(x: torch.Tensor, pad: int) -> torch.Tensor:
    """x [..., D] as a view (unit stride on D) of a buffer whose rows are D + pad wide, the last `pad` entries NaN."""
    buf = torch.full((*x.shape[:-1], x.shape[-1] + pad), float("nan"), dtype=x.dtype, device=x.device)
    buf[..., : x.shape[-1]] = x
    return buf[..., : x.shape[-1]]


def check_head_padding(device: torch.device, dims: tuple[int, int], heads: tuple[int, int] = (1, 2),
                       seed: int = 0) -> dict[str, ErrorStats | bool]:
    """The step and verify kernels at head dims whose tiles are padded (Dk or Dv not a power of two; the tiles are
    `triton_step.head_tiles`), with NaN in the memory their padded lanes address: q, k and v head rows are
    followed by a tile's width of NaN, so are the step pool's state rows (a view of a NaN-padded buffer) and its
    key rows (NaN rows after the Dk real ones), and the verify pool's rows are NaN but for its history states (its
    rows written are even, so an odd row follows each: a padded lane past a row's last head lands in NaN). A padded lane
    read unmasked puts NaN into the outputs or states (`error_stats` gives inf); one written unmasked overwrites
    NaN padding (`*_padding_kept` False). Also fresh sequences, history states and drafts 0-2, in fp32."""
    import triton

    from hybridcache.kernels.gated_delta.triton_step import gated_delta_rule_decode
    from hybridcache.kernels.gated_delta.triton_verify import gated_delta_rule_verify

    gen = torch.Generator().manual_seed(seed)
    hv, (dk, dv) = heads[1], dims
    pad_k, pad_v = triton.next_power_of_2(dk), triton.next_power_of_2(dv)  # (past any tile's overhang)

    # the step kernel: 4 sequences (two fresh), states in a NaN-padded view
    q, k, v, g, beta = _gdn_inputs(4, heads, dims, torch.float32, device, gen)
    context_lens = torch.tensor([1, 9, 1, 40], dtype=torch.int32, device=device)
    slots = torch.tensor([5, 0, 2, 3], device=device)
    states = (0.1 * torch.randn(6, hv, dk, dv, generator=gen)).to(device)
    buf = torch.full((6, hv, dk + pad_k, dv + pad_v), float("nan"), device=device)
    pool = buf[:, :, :dk, :dv]
    pool.copy_(states)
    out = gated_delta_rule_decode(_nan_padded(q, pad_k), _nan_padded(k, pad_k), _nan_padded(v, pad_v), g, beta, pool,
                                  slots, context_lens)
    initial = states[slots].masked_fill((context_lens == 1)[:, None, None, None], 0.0)
    ref_out, ref_state = delta_ref.gated_delta_rule_step(q, k, v, g, beta, initial)
    padding = torch.ones(buf.shape, dtype=torch.bool, device=device)
    padding[:, :, :dk, :dv] = False
    stats: dict[str, ErrorStats | bool] = {
        "step_out": error_stats(out, ref_out),
        "step_state": error_stats(pool[slots], ref_state),
        "step_padding_kept": bool(buf[padding].isnan().all()),
    }

    # the verify kernel: 3 sequences of 1 + drafts tokens; every pool row NaN but the two history states (rows 0 and
    # 2; the fresh sequence's slot 4 stays NaN: it must not be read), the rows written even
    drafts, history = [2, 0, 1], [150, 7, 0]
    lengths = [1 + n for n in drafts]
    q, k, v, g, beta = _gdn_inputs(sum(lengths), heads, dims, torch.float32, device, gen)
    num_rows = 2 * (3 + 3 * 2) + 1
    pool = torch.full((num_rows, hv, dk, dv), float("nan"), device=device)
    slots = torch.tensor([0, 2, 4], device=device)
    table = torch.tensor([[6, 8], [10, 12], [14, 16]], device=device)
    for i, hist in enumerate(history):
        if hist:
            hq, hk, hv_, hg, hb = _gdn_inputs(hist, heads, dims, torch.float32, torch.device("cpu"), gen)
            pool[slots[i]] = delta_ref.chunk_gated_delta_rule(hq, hk, hv_, hg, hb)[1].to(device)
    before = pool.clone()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    context = torch.tensor([h + n for h, n in zip(history, lengths, strict=True)], device=device)
    num_drafts = torch.tensor(drafts, dtype=torch.int32, device=device)
    out = gated_delta_rule_verify(_nan_padded(q, pad_k), _nan_padded(k, pad_k), _nan_padded(v, pad_v), g, beta, pool,
                                  slots, cu, context, table, num_drafts, states_only=False)
    got_out, ref_out, got_states, ref_states, written = [], [], [], [], []
    for i, n in enumerate(drafts):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        initial = before[slots[i]] if history[i] else torch.zeros_like(before[slots[i]])
        ref, after = delta_ref.gated_delta_rule_verify(q[rows], k[rows], v[rows], g[rows], beta[rows], initial)
        got_out.append(out[rows])
        ref_out.append(ref)
        targets = [*table[i, :n].tolist(), int(slots[i])]
        got_states.append(pool[targets])
        ref_states.append(torch.cat([after[:n], after[-1:]]))
        written += targets
    unwritten = torch.ones(num_rows, dtype=torch.bool, device=device)
    unwritten[written] = False
    stats.update({
        "verify_out": error_stats(torch.cat(got_out), torch.cat(ref_out)),
        "verify_states": error_stats(torch.cat(got_states), torch.cat(ref_states)),
        "verify_padding_kept": bool(pool[unwritten].isnan().all()),  # (the NaN rows and the unused draft rows)
    })
    return stats


def check_attention_lanes(dtype: torch.dtype, device: torch.device, head_dim: int, lengths: Sequence[int],
                          history: Sequence[int], page: int = 16, heads: tuple[int, int] = (4, 2), seed: int = 0,
                          num_splits: int = 1, lead: int = 0) -> dict[str, ErrorStats | bool]:
    """`write_kv` + the prefill kernel (its keys in `num_splits` splits), or the decode kernel when every length is 1,
    at any head dim, with NaN in the memory that lanes past the dim address (the tiles are the dim rounded up to a
    power of two, `triton_paged`): the new keys and values, q and the output are views whose head rows are followed
    by a tile's width of NaN, and the pool's slots outside the contexts hold NaN (`paged_kv`; its rows are exactly
    the dim wide, so a key or value read past a head's last lane meets the next head's or the next slot's). A lane
    read unmasked puts NaN into the output (`error_stats` gives inf); one written unmasked overwrites NaN padding
    (`out_padding_kept` False). lead > 0: the first `lead` sequences (one new token each) are a mixed step's
    decode rows, written by the decode kernel into the prefill kernel's output (`triton_backend`'s order: the
    prefill kernel's chunk table leaves their blocks out)."""
    import triton

    from hybridcache.kernels.attention.triton_paged import (
        default_prefill_config,
        paged_decode_attention,
        paged_prefill_attention,
        write_kv,
    )
    from hybridcache.kernels.varlen import chunk_indices

    gen = torch.Generator().manual_seed(seed)
    batch = varlen_batch(lengths, history, device, seed)
    num_q, num_kv = heads
    kv = paged_kv(batch, page, num_kv, head_dim, dtype, device, gen)
    num_tokens, pad = sum(lengths), triton.next_power_of_2(head_dim)
    q = torch.randn(num_tokens, num_q, head_dim, generator=gen).to(device, dtype)
    keys = torch.randn(num_tokens, num_kv, head_dim, generator=gen).to(device, dtype)
    values = torch.randn(num_tokens, num_kv, head_dim, generator=gen).to(device, dtype)
    ref_pool = kv.kv_pool.clone()
    attention_ref.write_kv(ref_pool, keys, values, kv.kv_rows)
    write_kv(kv.kv_pool, _nan_padded(keys, pad), _nan_padded(values, pad), kv.kv_rows)
    out_buf = torch.full((num_tokens, num_q, head_dim + pad), float("nan"), dtype=dtype, device=device)
    out, scale = out_buf[..., :head_dim], head_dim**-0.5
    padded_q = _nan_padded(q, pad)
    if all(n == 1 for n in lengths):
        paged_decode_attention(padded_q, kv.kv_pool, kv.block_tables, batch.context_lens, max(batch.context_lens_cpu),
                               scale=scale, out=out)
    else:
        assert all(n == 1 for n in lengths[:lead])
        block_m = default_prefill_config(pad, dtype).block_m
        table = chunk_indices(batch.cu_seqlens.long(), batch.query_lens_cpu, block_m)
        paged_prefill_attention(padded_q, kv.kv_pool, kv.block_tables, batch.cu_seqlens, batch.context_lens,
                                batch.query_lens_cpu, scale=scale, chunk_indices=table[lead:],
                                num_splits=num_splits, out=out)
        if lead:
            paged_decode_attention(padded_q[:lead], kv.kv_pool, kv.block_tables[:lead], batch.context_lens[:lead],
                                   max(batch.context_lens_cpu), scale=scale, out=out[:lead])
    ref = attention_ref.paged_attention(q.float(), ref_pool.float(), kv.block_tables, batch.cu_seqlens,
                                        batch.query_lens_cpu, batch.context_lens_cpu, scale=scale)
    return {"kv_write": error_stats(kv.kv_pool.nan_to_num(0.0), ref_pool.nan_to_num(0.0)),
            "out": error_stats(out, ref),
            "out_padding_kept": bool(out_buf[..., head_dim:].isnan().all())}
