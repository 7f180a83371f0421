"""The CUDA kernels on the GPU: accuracy against the torch reference, and speed against the chip's limits.

Run on a CUDA machine with flash-linear-attention importable, from the repository root:

    PYTHONUNBUFFERED=1 python benchmarks/gpu_kernels.py [--out DIR]

Prints two tables (accuracy: max abs / max rel / norm rel error of every output and final state, bf16 and fp32;
speed: median time of each kernel, its rate and the fraction of the measured ceiling) and writes them as
JSON to DIR/gpu_kernels.json (DIR defaults to $OUT, else the current directory).

Ceilings are measured first on the same device: copy bandwidth (a 4 GiB device-to-device copy, bytes read +
written) and the bf16 matrix rate (8192^3 torch.matmul on random data). Shapes are Qwen3-Next's per layer:
gated DeltaNet Hk=16, Hv=32, Dk=Dv=128, conv channels 8192, kernel 4; attention Hq=16, Hkv=2, D=256, pages of
64; MoE hidden 2048, expert intermediate 512, 64 experts top-8, no shared expert (the layer runs it as a dense MLP).

Counted work (what the rates divide by):
- GDN prefill FLOPs per token and value head: 6*Dk*Dv (state read, correction, update) + 2*64*(3*Dk + 2*Dv)
  (the chunk's intra products); GDN decode bytes: the fp32 state read and written once.
- conv bytes: x read + out written; attention prefill FLOPs: 4*Hq*D per visible (query, key) pair;
  attention decode bytes: every cached key and value read once; MoE FLOPs: 6*H*I per routed (token, expert).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridcache.kernels.attention import reference as attention_ref  # noqa: E402
from hybridcache.kernels.attention import triton_paged  # noqa: E402
from hybridcache.kernels.conv import reference as conv_ref  # noqa: E402
from hybridcache.kernels.conv.triton import causal_conv1d_decode, causal_conv1d_varlen  # noqa: E402
from hybridcache.kernels.gated_delta import reference as delta_ref  # noqa: E402
from hybridcache.kernels.gated_delta.fla import chunk_gated_delta_rule_varlen  # noqa: E402
from hybridcache.kernels.gated_delta.triton_step import gated_delta_rule_decode  # noqa: E402
from hybridcache.kernels.moe import reference as moe_ref  # noqa: E402
from hybridcache.kernels.moe.grouped import ExpertWeights, grouped_experts  # noqa: E402
from hybridcache.kernels.varlen import chunk_indices  # noqa: E402
from tests.kernels import cuda_checks  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
HK, HV, DK, DV, CONV_K = 16, 32, 128, 128, 4
CONV_C = 2 * HK * DK + HV * DV
HQ, HKV, HEAD_DIM, PAGE = 16, 2, 256, 64


def median_ms(fn, rep: int = 100) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def once_ms(fn) -> float:
    """One timed call after one warm-up (for slow references)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def ceilings() -> dict[str, float]:
    src = torch.empty(1 << 31, dtype=BF16, device=DEV).normal_()
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), rep=50)
    src = dst = None  # free the 8 GiB before the matrix product
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    mm_ms = median_ms(lambda: a @ b, rep=50)
    return {"copy_GBps": 2 * (1 << 32) / copy_ms / 1e6, "bf16_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


# --- accuracy ----------------------------------------------------------------------------------------------------

def accuracy_rows() -> list[dict]:
    decode_hist = tuple(h + n - 1 for h, n in zip(cuda_checks.HISTORY, cuda_checks.LENGTHS, strict=True))
    ones = (1,) * len(cuda_checks.LENGTHS)
    cases = {
        "gdn chunk (fla)": lambda dt: cuda_checks.check_gated_delta(dt, DEV),
        "decode steps (conv, gdn)": lambda dt: cuda_checks.check_decode_step(dt, DEV),
        "conv varlen": lambda dt: cuda_checks.check_conv(dt, DEV),
        "attn prefill p16 d256": lambda dt: cuda_checks.check_attention(dt, DEV, page=16, heads=(16, 2),
                                                                         head_dim=256),
        "attn prefill p64 d128": lambda dt: cuda_checks.check_attention(dt, DEV, page=64, heads=(8, 2),
                                                                         head_dim=128),
        "attn decode p16 d256": lambda dt: cuda_checks.check_attention(dt, DEV, ones, decode_hist, page=16,
                                                                        heads=(16, 2), head_dim=256),
        "moe grouped": lambda dt: cuda_checks.check_moe(dt, DEV),
        "moe triton": lambda dt: cuda_checks.check_moe(dt, DEV, block_m=32),
    }
    rows = []
    for dtype in (BF16, torch.float32):
        for name, case in cases.items():
            try:
                for output, stats in case(dtype).items():
                    rows.append({"kernel": name, "dtype": str(dtype).removeprefix("torch."), "output": output,
                                 "max_abs": stats.max_abs, "max_rel": stats.max_rel, "norm_rel": stats.norm_rel})
            except Exception as exc:  # noqa: BLE001 - one broken kernel must not hide the others' rows
                traceback.print_exc()
                rows.append({"kernel": name, "dtype": str(dtype), "output": f"ERROR {type(exc).__name__}: {exc}"})
    return rows


# --- speed -------------------------------------------------------------------------------------------------------

def _batch(lengths: list[int], history: list[int]) -> cuda_checks.VarlenBatch:
    return cuda_checks.varlen_batch(lengths, history, DEV)


def bench_gdn(limits: dict) -> list[dict]:
    rows = []
    for label, lengths in (("1 x 16384", [16384]), ("64 x 1024", [1024] * 64)):
        batch = _batch(lengths, [0] * len(lengths))
        tokens = sum(lengths)
        q, k = (torch.randn(tokens, HK, DK, device=DEV, dtype=BF16) for _ in range(2))
        v = torch.randn(tokens, HV, DV, device=DEV, dtype=BF16)
        g = -F.softplus(torch.randn(tokens, HV, device=DEV) - 1)
        beta = torch.rand(tokens, HV, device=DEV, dtype=BF16)
        pool = torch.zeros(batch.num_slots, HV, DK, DV, device=DEV)
        table = chunk_indices(batch.cu_seqlens, batch.query_lens_cpu, 64)

        def run(q=q, k=k, v=v, g=g, beta=beta, pool=pool, batch=batch, table=table):
            chunk_gated_delta_rule_varlen(q, k, v, g, beta, pool, batch.state_slots, batch.cu_seqlens,
                                          batch.context_lens, batch.query_lens_cpu, chunk_indices=table)

        ms = median_ms(run)
        flops = tokens * HV * (6 * DK * DV + 2 * 64 * (3 * DK + 2 * DV))
        row = {"kernel": "gdn prefill (fla chunk)", "shape": label, "ms": ms, "rate": flops / ms / 1e9,
               "unit": "TFLOP/s", "of_ceiling": flops / ms / 1e9 / limits["bf16_TFLOPs"],
               "tokens_per_s": tokens / ms * 1e3}
        if label == "64 x 1024":
            starts = batch.cu_seqlens.tolist()

            def ref(q=q, k=k, v=v, g=g, beta=beta, starts=starts, lengths=lengths):
                for i, n in enumerate(lengths):
                    rows_ = slice(starts[i], starts[i] + n)
                    delta_ref.chunk_gated_delta_rule(q[rows_], k[rows_], v[rows_], g[rows_], beta[rows_])

            row["reference_ms"] = once_ms(ref)
        rows.append(row)

    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    num = 256
    batch = _batch([1] * num, [100] * num)
    q, k = (torch.randn(num, HK, DK, device=DEV, dtype=BF16) for _ in range(2))
    v = torch.randn(num, HV, DV, device=DEV, dtype=BF16)
    g = -F.softplus(torch.randn(num, HV, device=DEV) - 1)
    beta = torch.rand(num, HV, device=DEV, dtype=BF16)
    pool = 0.1 * torch.randn(batch.num_slots, HV, DK, DV, device=DEV)
    state_bytes = 2 * num * HV * DK * DV * 4

    def ours():
        gated_delta_rule_decode(q, k, v, g, beta, pool, batch.state_slots, batch.context_lens)

    def fla_gather_scatter():
        h0 = pool.index_select(0, batch.state_slots)
        _, ht = fused_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                                 initial_state=h0, output_final_state=True,
                                                 use_qk_l2norm_in_kernel=True)
        pool.index_copy_(0, batch.state_slots, ht)

    def ref():
        out, state = delta_ref.gated_delta_rule_step(q, k, v, g, beta, pool[batch.state_slots])
        pool.index_copy_(0, batch.state_slots, state)

    for name, fn in (("gdn decode (triton in-place)", ours), ("gdn decode (fla recurrent + gather)",
                                                                fla_gather_scatter)):
        ms = median_ms(fn)
        rows.append({"kernel": name, "shape": f"{num} seqs", "ms": ms, "rate": state_bytes / ms / 1e6,
                     "unit": "GB/s", "of_ceiling": state_bytes / ms / 1e6 / limits["copy_GBps"],
                     "reference_ms": median_ms(ref, rep=20) if name.endswith("in-place)") else None})
    return rows


def bench_conv(limits: dict) -> list[dict]:
    rows = []
    lengths = [1024] * 64
    batch = _batch(lengths, [7] * 64)
    tokens = sum(lengths)
    x = torch.randn(tokens, CONV_C, device=DEV, dtype=BF16)
    w = torch.randn(CONV_C, CONV_K, device=DEV, dtype=BF16)
    pool = torch.randn(batch.num_slots, CONV_C, CONV_K - 1, device=DEV, dtype=BF16)
    table = chunk_indices(batch.cu_seqlens, batch.query_lens_cpu, 64)
    ms = median_ms(lambda: causal_conv1d_varlen(x, w, None, pool, batch.state_slots, batch.cu_seqlens,
                                                batch.context_lens, batch.query_lens_cpu, chunk_indices=table))
    nbytes = 2 * x.numel() * 2
    starts = batch.cu_seqlens.tolist()

    def ref():
        for i, n in enumerate(lengths):
            conv_ref.causal_conv1d(x[starts[i]:starts[i] + n], w, None, pool[batch.state_slots[i]])

    rows.append({"kernel": "conv varlen", "shape": "64 x 1024", "ms": ms, "rate": nbytes / ms / 1e6, "unit": "GB/s",
                 "of_ceiling": nbytes / ms / 1e6 / limits["copy_GBps"], "reference_ms": once_ms(ref)})
    num = 256
    batch = _batch([1] * num, [50] * num)
    xd = torch.randn(num, CONV_C, device=DEV, dtype=BF16)
    ms = median_ms(lambda: causal_conv1d_decode(xd, w, None, pool, batch.state_slots, batch.context_lens))
    nbytes = num * CONV_C * 2 * (2 + 2 * (CONV_K - 1))
    rows.append({"kernel": "conv decode", "shape": f"{num} seqs", "ms": ms, "rate": nbytes / ms / 1e6,
                 "unit": "GB/s", "of_ceiling": nbytes / ms / 1e6 / limits["copy_GBps"]})
    return rows


def _attention_setup(lengths: list[int], history: list[int]):
    batch = _batch(lengths, history)
    gen = torch.Generator().manual_seed(0)
    kv = cuda_checks.paged_kv(batch, PAGE, HKV, HEAD_DIM, BF16, DEV, gen)
    q = torch.randn(sum(lengths), HQ, HEAD_DIM, device=DEV, dtype=BF16)
    return batch, kv, q


def bench_attention(limits: dict) -> list[dict]:
    rows = []
    scale = HEAD_DIM**-0.5
    configs = [triton_paged.PrefillConfig(64, 64, 4, 2), triton_paged.PrefillConfig(128, 64, 8, 2),
               triton_paged.PrefillConfig(128, 32, 8, 2), triton_paged.PrefillConfig(64, 32, 4, 3)]
    for label, lengths, history in (("1 x 16384", [16384], [0]), ("64 x 1024", [1024] * 64, [0] * 64),
                                    ("2048 after 14336 cached", [2048], [14336])):
        batch, kv, q = _attention_setup(lengths, history)
        pairs = sum(sum(h + i + 1 for i in range(n)) for n, h in zip(lengths, history, strict=True))
        flops = 4 * HQ * HEAD_DIM * pairs
        for cfg in configs if label == "1 x 16384" else [None]:
            def run(q=q, kv=kv, batch=batch, cfg=cfg):
                triton_paged.paged_prefill_attention(q, kv.kv_pool, kv.block_tables, batch.cu_seqlens,
                                                     batch.context_lens, batch.query_lens_cpu, scale=scale,
                                                     config=cfg)
            try:
                ms = median_ms(run)
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit must not end the sweep
                rows.append({"kernel": "attn prefill (triton paged)", "shape": f"{label} {cfg}", "ms": None,
                             "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                continue
            row = {"kernel": "attn prefill (triton paged)", "shape": label if cfg is None else f"{label} {cfg}",
                   "ms": ms, "rate": flops / ms / 1e9, "unit": "TFLOP/s",
                   "of_ceiling": flops / ms / 1e9 / limits["bf16_TFLOPs"]}
            if label == "64 x 1024":
                row["reference_ms"] = once_ms(lambda q=q, kv=kv, batch=batch: attention_ref.paged_attention(
                    q, kv.kv_pool, kv.block_tables, batch.cu_seqlens, batch.query_lens_cpu,
                    batch.context_lens_cpu, scale=scale))
            rows.append(row)
        if label == "1 x 16384":  # a library flash kernel on the same, unpaged problem, for comparison
            qs = q.transpose(0, 1)[None]  # kv heads expanded up front, so the flash backend applies
            ks = torch.randn(1, HQ, 16384, HEAD_DIM, device=DEV, dtype=BF16)
            vs = torch.randn_like(ks)
            ms = median_ms(lambda qs=qs, ks=ks, vs=vs: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
            rows.append({"kernel": "torch SDPA (contiguous, not paged)", "shape": label, "ms": ms,
                         "rate": flops / ms / 1e9, "unit": "TFLOP/s",
                         "of_ceiling": flops / ms / 1e9 / limits["bf16_TFLOPs"]})
    for label, num, ctx in (("64 seqs x 4096", 64, 4096), ("1 seq x 16000", 1, 16000)):
        batch, kv, q = _attention_setup([1] * num, [ctx - 1] * num)
        nbytes = num * ctx * HKV * HEAD_DIM * 2 * 2
        ms = median_ms(lambda q=q, kv=kv, batch=batch, ctx=ctx: triton_paged.paged_decode_attention(
            q, kv.kv_pool, kv.block_tables, batch.context_lens, ctx, scale=scale))
        ref_ms = once_ms(lambda q=q, kv=kv, batch=batch: attention_ref.paged_decode_attention(
            q, kv.kv_pool, kv.block_tables, batch.context_lens, scale=scale))
        rows.append({"kernel": "attn decode (triton split-KV)", "shape": label, "ms": ms, "rate": nbytes / ms / 1e6,
                     "unit": "GB/s", "of_ceiling": nbytes / ms / 1e6 / limits["copy_GBps"], "reference_ms": ref_ms})
    return rows


def bench_moe(limits: dict) -> list[dict]:
    hidden, inter, experts, top_k = 2048, 512, 64, 8
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(experts, inter, hidden, generator=gen).to(DEV, BF16) / hidden**0.5 for _ in range(2))
    down = torch.randn(experts, hidden, inter, generator=gen).to(DEV, BF16) / inter**0.5
    stacked = ExpertWeights.stack(list(gate), list(up), list(down))
    rows = []
    for num in (16384, 64):
        x = torch.randn(num, hidden, device=DEV, dtype=BF16)
        weights, ids = cuda_checks.routing(num, experts, top_k, BF16, DEV, gen)
        ms = median_ms(lambda x=x, weights=weights, ids=ids: grouped_experts(x, weights, ids, stacked))
        ref_ms = once_ms(lambda x=x, weights=weights, ids=ids: moe_ref.routed_experts(
            x, weights, ids, list(gate), list(up), list(down)))
        flops = num * top_k * 6 * hidden * inter
        weight_bytes = experts * 3 * hidden * inter * 2
        rows.append({"kernel": "moe routed experts (grouped_mm)", "shape": f"{num} tokens", "ms": ms,
                     "rate": flops / ms / 1e9, "unit": "TFLOP/s",
                     "of_ceiling": flops / ms / 1e9 / limits["bf16_TFLOPs"],
                     "weights_GBps": weight_bytes / ms / 1e6, "reference_ms": ref_ms})
        # where the time goes: one grouped GEMM (gate_up) alone, tokens spread evenly over the experts
        per_expert = num * top_k // experts
        offs = torch.arange(1, experts + 1, device=DEV, dtype=torch.int32) * per_expert
        xs = torch.randn(per_expert * experts, hidden, device=DEV, dtype=BF16)
        ms_mm = median_ms(lambda xs=xs, offs=offs: torch._grouped_mm(xs, stacked.gate_up.transpose(1, 2), offs=offs))
        mm_flops = 4 * per_expert * experts * hidden * inter
        rows.append({"kernel": "  grouped_mm gate_up alone", "shape": f"{num} tokens", "ms": ms_mm,
                     "rate": mm_flops / ms_mm / 1e9, "unit": "TFLOP/s",
                     "of_ceiling": mm_flops / ms_mm / 1e9 / limits["bf16_TFLOPs"],
                     "weights_GBps": stacked.gate_up.numel() * 2 / ms_mm / 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skip-accuracy", action="store_true")
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    try:
        import fla

        result["fla"] = fla.__version__
    except ImportError:
        result["fla"] = None
    result["limits"] = ceilings()
    print("limits:", result["limits"], flush=True)
    result["accuracy"] = [] if args.skip_accuracy else accuracy_rows()
    result["host_syncs"] = cuda_checks.host_syncs(DEV)
    print("host syncs:", result["host_syncs"], flush=True)
    result["speed"] = []
    for bench in (bench_gdn, bench_conv, bench_attention, bench_moe):
        try:
            result["speed"] += bench(result["limits"])
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            result["speed"].append({"kernel": bench.__name__, "error": traceback.format_exc()[-500:]})
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_kernels.json").write_text(json.dumps(result, indent=1))

    print(f"\n{result['device']}  torch {result['torch']}  triton {result['triton']}  fla {result['fla']}")
    print(f"ceilings: copy {result['limits']['copy_GBps']:.0f} GB/s, bf16 matmul {result['limits']['bf16_TFLOPs']:.0f}"
          " TFLOP/s")
    print(f"\n{'kernel':28} {'dtype':9} {'output':17} {'max_abs':>10} {'max_rel':>10} {'norm_rel':>10}")
    for r in result["accuracy"]:
        if "max_abs" not in r:
            print(f"{r['kernel']:28} {r['dtype']:9} {r['output']}")
            continue
        print(f"{r['kernel']:28} {r['dtype']:9} {r['output']:17} {r['max_abs']:10.2e} {r['max_rel']:10.2e} "
              f"{r['norm_rel']:10.2e}")
    print(f"\n{'kernel':38} {'shape':44} {'ms':>9} {'rate':>9} {'unit':8} {'of max':>7} {'ref ms':>9}")
    for r in result["speed"]:
        if r.get("ms") is None:
            print(f"{r['kernel']:38} {r.get('shape', ''):44} ERROR {r.get('error', '')[-300:]}")
            continue
        ref = f"{r['reference_ms']:9.2f}" if r.get("reference_ms") else ""
        extra = f"  weights {r['weights_GBps']:.0f} GB/s" if r.get("weights_GBps") else ""
        print(f"{r['kernel']:38} {r['shape']:44} {r['ms']:9.4f} {r['rate']:9.1f} {r['unit']:8} "
              f"{r['of_ceiling']:7.1%} {ref:>9}{extra}")
    print("\nhost syncs (bf16, warm):", result["host_syncs"])


if __name__ == "__main__":
    main()
