"""Kimi Linear's MLA attention on the GPU: the latent kernel (`attention/triton_latent.py`, what the engine runs
since the latent cache) against the paged GQA kernels over the expanded keys and values it replaced
(`attention/triton_paged.py`, 32 heads of 192, values padded), at Kimi-Linear-48B's widths, one layer, bf16; and the
latent kernel at other tiles (`SWEEP`); and the engine's op (`CudaBackend.mla_attention`: the step's rows written,
then decode absorbed, prefill expanded with its up-projection GEMMs, in windows of keys past 32,768 context tokens),
checked against the torch reference where it fits.

    PYTHONUNBUFFERED=1 python benchmarks/latent_attention_bench.py [--out DIR]

Each case times the attention alone (median of `triton.testing.do_bench`, CUDA-graph replays for the decode
cases), the latent path's time including its absorbed up-projections on either side (the two einsums of
`KimiMLA`; the expanded path's kv_b_proj of the step's own tokens is left out, so the comparison flatters the old
path), and the KV bytes each layout reads. Checks the latent kernel against the torch reference first (bf16
within 2e-2 of the fp32 reference). Prints a table and writes DIR/latent_attention.json (DIR: $OUT or .).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridcache.kernels.attention import latent, triton_latent, triton_paged  # noqa: E402

DEV, BF16 = torch.device("cuda"), torch.bfloat16
HEADS, RANK, SHARED, NOPE, VDIM, PAGE = 32, 512, 64, 128, 128, 16
E = RANK + SHARED
SCALE = (NOPE + SHARED) ** -0.5
L = triton_latent.LatentConfig
SWEEP = [L(32, 64, 64, 128, 4), L(32, 64, 64, 256, 8), L(32, 32, 64, 512, 8), L(32, 64, 32, 512, 8),
         L(64, 64, 64, 128, 8), L(128, 64, 64, 128, 8), L(64, 32, 64, 256, 8), L(16, 64, 64, 128, 4)]
# (name, query lengths, cached tokens before them)
CASES = [
    ("decode 64 x 1,024", (1,) * 64, (1023,) * 64),
    ("decode 8 x 8,192", (1,) * 8, (8191,) * 8),
    ("decode 1 x 32,768", (1,), (32767,)),
    ("decode 1 x 131,072", (1,), (131071,)),
    ("prefill 1 x 2,048 fresh", (2048,), (0,)),
    ("prefill chunk 2,048 over 30,000", (2048,), (30000,)),
    ("prefill chunk 2,048 over 100,000", (2048,), (100000,)),
    ("prefill chunk 32 over 30,000", (32,), (30000,)),
    ("prefill chunk 128 over 30,000", (128,), (30000,)),
    ("prefill chunk 200 over 16,000", (200,), (16000,)),  # phase C's + 200 request
    ("mixed 32 decodes x 8,192 + chunk 2,048 over 4,000", (1,) * 32 + (2048,), (8191,) * 32 + (4000,)),
    ("prefill 16 x 1,024 fresh", (1024,) * 16, (0,) * 16),
]


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def graph_ms(fn) -> float:
    """Median of CUDA-graph replays (a decode step runs in a graph in the engine)."""
    fn()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def batch(lengths, history):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    ctx = [h + q for h, q in zip(history, lengths, strict=True)]
    pages = [-(-c // PAGE) for c in ctx]
    table = torch.zeros(len(ctx), max(pages), dtype=torch.int32)
    start = 0
    for i, count in enumerate(pages):
        table[i, :count] = torch.arange(start, start + count)
        start += count
    return cu, torch.tensor(ctx, dtype=torch.int32, device=DEV), table.to(DEV), ctx, start


def time_latent(lengths, history, row: dict) -> None:
    """The latent kernel alone and with its up-projections; its error against the fp32 reference."""
    cu, ctx_dev, table, ctx, num_pages = batch(lengths, history)
    tokens, max_ctx = sum(lengths), max(ctx)
    gen = torch.Generator(device=DEV).manual_seed(0)
    pool = torch.randn(2, num_pages, PAGE, 1, E // 2, device=DEV, generator=gen).to(BF16)
    absorbed = torch.randn(tokens, HEADS, E, device=DEV, generator=gen).to(BF16)
    q_nope = torch.randn(tokens, HEADS, NOPE, device=DEV, generator=gen).to(BF16)
    w_uk = torch.randn(HEADS, NOPE, RANK, device=DEV, generator=gen).to(BF16) * RANK**-0.5
    w_uv = torch.randn(HEADS, VDIM, RANK, device=DEV, generator=gen).to(BF16) * RANK**-0.5

    def ours():
        return triton_latent.latent_attention(absorbed, pool, table, cu, ctx_dev, lengths, max_ctx, scale=SCALE,
                                              value_dim=RANK)

    def ours_with_projections():
        q = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), absorbed[..., RANK:]], dim=-1)
        lat = triton_latent.latent_attention(q, pool, table, cu, ctx_dev, lengths, max_ctx, scale=SCALE,
                                             value_dim=RANK)
        return torch.einsum("thr,hvr->thv", lat, w_uv)

    if sum(ctx) <= 300_000:  # the reference gathers every context: only where it fits comfortably
        ref = latent.latent_attention(absorbed.float(), pool.float(), table, cu, lengths, ctx, scale=SCALE,
                                      value_dim=RANK)
        row["max_rel_err"] = ((ours().float() - ref).abs().max() / ref.abs().max()).item()
    timer = graph_ms if all(n == 1 for n in lengths) else median_ms
    row["latent_ms"] = timer(ours)
    row["latent_with_up_projections_ms"] = timer(ours_with_projections)
    sweep = {}
    for cfg in SWEEP:  # other tiles, the engine's default aside (each checked against the default's output)
        def tiled(cfg=cfg):
            return triton_latent.latent_attention(absorbed, pool, table, cu, ctx_dev, lengths, max_ctx, scale=SCALE,
                                                  value_dim=RANK, config=cfg)
        try:
            if not torch.allclose(tiled().float(), ours().float(), rtol=2e-2, atol=2e-2):
                sweep[str(cfg)] = "differs"
                continue
            sweep[str(cfg)] = timer(tiled)
        except Exception as error:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
            sweep[str(cfg)] = repr(error)[:120]
    row["sweep_ms"] = sweep
    row["latent_kv_bytes"] = sum(ctx) * E * 2
    row["latent_read_tb_s"] = row["latent_kv_bytes"] / row["latent_ms"] / 1e9


def time_expanded(lengths, history, row: dict) -> None:
    """The paged GQA kernels over every head's keys and values (192 wide, values padded): the old layout."""
    cu, ctx_dev, table, ctx, num_pages = batch(lengths, history)
    tokens, max_ctx = sum(lengths), max(ctx)
    gen = torch.Generator(device=DEV).manual_seed(1)
    expanded = torch.randn(2, num_pages, PAGE, HEADS, NOPE + SHARED, device=DEV, generator=gen).to(BF16)
    query = torch.randn(tokens, HEADS, NOPE + SHARED, device=DEV, generator=gen).to(BF16)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    block_m = triton_paged.default_prefill_config(256, BF16).block_m
    splits = triton_paged.prefill_splits(-(-tokens // block_m) * HEADS, max_ctx, sms)

    def decode():
        return triton_paged.paged_decode_attention(query, expanded, table, ctx_dev, max_ctx, scale=SCALE)

    def prefill():
        return triton_paged.paged_prefill_attention(query, expanded, table, cu, ctx_dev, lengths, scale=SCALE,
                                                    num_splits=splits)

    row["expanded_ms"] = graph_ms(decode) if all(n == 1 for n in lengths) else median_ms(prefill)
    row["expanded_kv_bytes"] = sum(ctx) * 2 * HEADS * (NOPE + SHARED) * 2


def time_engine(lengths, history, row: dict) -> None:
    """The engine's MLA op on a step of these lengths (`CudaBackend.mla_attention`, the Triton attention backend):
    its time with the step's writes and up-projections, and its error against the fp32 torch reference."""
    from hybridcache.forward_batch import ForwardBatch
    from hybridcache.kernels.attention import mla_prefill
    from hybridcache.kernels.attention.triton_backend import TritonAttention
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.cuda_backend import CudaBackend

    cu, ctx_dev, table, ctx, num_pages = batch(lengths, history)
    tokens = sum(lengths)
    gen = torch.Generator(device=DEV).manual_seed(2)
    pool = torch.randn(2, num_pages, PAGE, 1, E // 2, device=DEV, generator=gen).to(BF16)
    rows = torch.randn(tokens, E, device=DEV, generator=gen).to(BF16)
    q_nope = torch.randn(tokens, HEADS, NOPE, device=DEV, generator=gen).to(BF16)
    q_shared = torch.randn(tokens, HEADS, SHARED, device=DEV, generator=gen).to(BF16)
    w_uk = torch.randn(HEADS, NOPE, RANK, device=DEV, generator=gen).to(BF16) * RANK**-0.5
    w_uv = torch.randn(HEADS, VDIM, RANK, device=DEV, generator=gen).to(BF16) * RANK**-0.5
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(lengths, ctx, strict=True)]).to(DEV)
    host_table = table.cpu()
    kv_rows = torch.tensor([int(host_table[i, p // PAGE]) * PAGE + p % PAGE
                            for i, (n, c) in enumerate(zip(lengths, ctx, strict=True)) for p in range(c - n, c)],
                           dtype=torch.int64, device=DEV)
    step = ForwardBatch(input_ids=torch.zeros(tokens, dtype=torch.int64, device=DEV), positions=positions,
                        cu_seqlens=cu, context_lens=ctx_dev, block_tables=table, kv_rows=kv_rows,
                        state_slots=torch.arange(len(lengths), device=DEV), logits_indices=(cu[1:] - 1).long(),
                        query_lens_cpu=tuple(lengths), context_lens_cpu=tuple(ctx))
    backend = CudaBackend(TritonAttention())
    prepared = backend.prepare(step)
    plan = mla_prefill.plan(step.query_lens_cpu, step.context_lens_cpu, PAGE)
    row["engine_plan"] = "absorbed" if plan is None else f"lead {plan.lead}, window {plan.window}"
    if plan is None:  # also time it expanded (`EXPAND_MIN_QUERIES` at 1): where the threshold should sit
        forced = mla_prefill.EXPAND_MIN_QUERIES
        mla_prefill.EXPAND_MIN_QUERIES = 1
        try:
            row["engine_expanded_ms"] = median_ms(lambda: backend.mla_attention(q_nope, q_shared, rows, w_uk, w_uv,
                                                                                pool, prepared, scale=SCALE))
        finally:
            mla_prefill.EXPAND_MIN_QUERIES = forced

    def engine():
        return backend.mla_attention(q_nope, q_shared, rows, w_uk, w_uv, pool, prepared, scale=SCALE)

    if sum(ctx) <= 300_000:
        reference = ReferenceBackend()
        f32 = [t.float() for t in (q_nope, q_shared, rows, w_uk, w_uv)]
        want = reference.mla_attention(*f32, pool.float(), reference.prepare(step), scale=SCALE)
        row["engine_max_rel_err"] = ((engine().float() - want).abs().max() / want.abs().max()).item()
    row["engine_ms"] = median_ms(engine)


def run_case(name, lengths, history) -> dict:
    row = {"case": name, "tokens": sum(lengths), "max_context": max(h + n for h, n in zip(history, lengths))}
    time_latent(lengths, history, row)
    torch.cuda.empty_cache()
    time_expanded(lengths, history, row)
    torch.cuda.empty_cache()
    if not all(n == 1 for n in lengths):
        time_engine(lengths, history, row)
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    rows = []
    for name, lengths, history in CASES:
        try:
            rows.append(run_case(name, lengths, history))
        except Exception as error:  # a case that fails is reported, and the others still run
            rows.append({"case": name, "error": repr(error)})
        print(rows[-1], flush=True)
    print("\n| case | latent ms | + up-projections | expanded ms | latent / expanded | KV bytes latent / expanded |"
          " max rel err |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | error: {r['error'][:80]} | | | | | |")
            continue
        print(f"| {r['case']} | {r['latent_ms']:.3f} | {r['latent_with_up_projections_ms']:.3f} | "
              f"{r['expanded_ms']:.3f} | {r['latent_ms'] / r['expanded_ms']:.2f} | "
              f"{r['latent_kv_bytes'] / 1e6:.1f} MB / {r['expanded_kv_bytes'] / 1e6:.1f} MB | "
              f"{r.get('max_rel_err', float('nan')):.1e} |")
    print("\nThe engine's op (CudaBackend.mla_attention: writes, up-projections, expansion), prefill steps:")
    for r in rows:
        if "engine_ms" in r:
            err = r.get("engine_max_rel_err", float("nan"))
            forced = f", expanded {r['engine_expanded_ms']:.3f}" if "engine_expanded_ms" in r else ""
            print(f"  {r['case']}: {r['engine_plan']}: {r['engine_ms']:.3f} ms{forced} against absorbed "
                  f"{r['latent_with_up_projections_ms']:.3f}; max rel err {err:.1e}")
    print("\nTiles (LatentConfig(block_m, block_n, block_e, block_v, num_warps)), ms:")
    for r in rows:
        if "sweep_ms" in r:
            timed = {k: v for k, v in r["sweep_ms"].items() if isinstance(v, float)}
            best = min(timed, key=timed.get) if timed else "none"
            print(f"  {r['case']}: default {r['latent_ms']:.3f}, best {best} {timed.get(best, float('nan')):.3f};",
                  {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r["sweep_ms"].items()})
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "latent_attention.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
