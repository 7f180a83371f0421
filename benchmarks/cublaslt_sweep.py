"""The decode step's dense GEMMs: cuBLAS's choice against each algorithm of cuBLASLt's list per shape (issue 32).

    PYTHONPATH=. python benchmarks/cublaslt_sweep.py [--model next-16b] [--model dense-9b ...] [--rows 16,32,64]
        [--limit 64] [--out DIR]

Needs CUDA and NVIDIA's `nvmath-python` (with `cuda-bindings`, `cuda-core` and `cuda-pathfinder`; torch's own
cuBLASLt library is the one found). For each dense linear of one decode step of a `gpu_bench.py` model
(`dense_gemm_sweep.step_linears`: the shapes from its config, nothing built or loaded) and each row count, with a
random bf16 weight and its random copies past L2 (as `kernels/gemm/dense.decide` times its candidates):
- `F.linear` (cuBLAS's heuristic: what the engine runs at 64 rows), timed as `dense.replay_us` times it (one CUDA
  graph of 20 GEMMs over the weight copies, the median of 5 replays);
- the same GEMM through cuBLASLt's API (nvmath's raw bindings, `LtGemm`: fp32 accumulation, 32 MiB workspace),
  once per algorithm of the heuristic's list for the shape (up to `--limit`), each timed the same way;
- every algorithm's output is checked against `F.linear` in fp32 (max |diff| / max |ref|).
Prints one row per (linear, rows): cuBLAS us, the best cuBLASLt algorithm's us and its index, how many algorithms
ran, failed or were off, and writes DIR/cublaslt_sweep.json (DIR: --out, else $OUT, else .). Then the step's dense
GEMM total at each row count, cuBLAS against the best of both per shape, and the floor.

torch's TunableOp does not search here: on CUDA its GEMM op registers only the default cuBLAS call (the algorithm
search is ROCm's). This script asks whether a start-up search over cuBLASLt's algorithms (a candidate of
`dense.decide`) would pay.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dense_gemm_sweep import COPY_RATE, step_linears  # noqa: E402
from gpu_bench import QWEN_MODELS  # noqa: E402

from hybridcache.kernels.gemm import dense  # noqa: E402

COLD_COPIES = 3  # weights per timed graph: with the first, past the H200's 50 MB L2 for every shape but the smallest


def weight_copies(n: int, k: int, device: torch.device) -> list[torch.Tensor]:
    """Random bf16 weights [N, K] at std 1/sqrt(K): enough copies that one graph of GEMMs reads them from memory."""
    gen = torch.Generator(device=device).manual_seed(n * 7 + k)
    bytes_one = 2 * n * k
    count = max(COLD_COPIES, -(-160 * 2**20 // bytes_one))
    return [(torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(torch.bfloat16) for _ in range(count)]


class LtGemm:
    """x [m, K] @ W^T for W [N, K] in bf16 (fp32 accumulation) through cuBLASLt's own API, posed as torch poses
    `F.linear` in column-major terms: D [N, m] = op_T(W^T [K, N]) @ x^T [K, m]. `algorithms` is the heuristic's
    list for the shape (up to `limit`); `run(x, w, index)` launches one of them on the current stream with a fixed
    workspace and output, so it can be captured in a CUDA graph."""

    def __init__(self, n: int, k: int, m: int, limit: int, device: torch.device) -> None:
        import numpy as np
        from nvmath.bindings import cublas
        from nvmath.bindings import cublasLt as lt
        from nvmath.linalg._internal import matmul_desc_ifc, matmul_pref_ifc

        self.lt = lt
        bf16, f32 = 14, 0  # cudaDataType: CUDA_R_16BF, CUDA_R_32F
        workspace = 32 * 2**20
        self.handle = lt.create()
        self.desc = lt.matmul_desc_create(cublas.ComputeType.COMPUTE_32F, f32)
        matmul_desc_ifc.MatmulDescInterface(self.desc).transa = cublas.Operation.T
        self.a = lt.matrix_layout_create(bf16, rows=k, cols=n, ld=k)
        self.b = lt.matrix_layout_create(bf16, rows=k, cols=m, ld=k)
        self.d = lt.matrix_layout_create(bf16, rows=n, cols=m, ld=n)
        self.pref = lt.matmul_preference_create()
        matmul_pref_ifc.MatmulPreferenceInterface(self.pref).max_workspace_bytes = workspace
        results = lt.MatmulHeuristicResult(limit)
        count = np.zeros(1, dtype=np.int32)
        lt.matmul_algo_get_heuristic(self.handle, self.desc, self.a, self.b, self.d, self.d, self.pref, limit,
                                     results.ptr, count.ctypes.data)
        # a plain structured array (a copy): its "algo" field's element i is the struct to pass by pointer
        self.algorithms = np.frombuffer(bytes(memoryview(results)), dtype=lt.matmul_heuristic_result_dtype)
        self.algorithms = self.algorithms[: int(count[0])]
        self.workspace = torch.empty(workspace, dtype=torch.uint8, device=device)
        self.alpha = np.ones(1, dtype=np.float32)
        self.beta = np.zeros(1, dtype=np.float32)
        self.out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        self.device = device

    def run(self, x: torch.Tensor, w: torch.Tensor, index: int) -> torch.Tensor:
        algo = self.algorithms["algo"][index : index + 1]
        self.lt.matmul(self.handle, self.desc, self.alpha.ctypes.data, w.data_ptr(), self.a, x.data_ptr(), self.b,
                       self.beta.ctypes.data, self.out.data_ptr(), self.d, self.out.data_ptr(), self.d,
                       algo.ctypes.data, self.workspace.data_ptr(), self.workspace.numel(),
                       torch.cuda.current_stream(self.device).cuda_stream)
        return self.out

    def close(self) -> None:
        for layout in (self.a, self.b, self.d):
            self.lt.matrix_layout_destroy(layout)
        self.lt.matmul_preference_destroy(self.pref)
        self.lt.matmul_desc_destroy(self.desc)
        self.lt.destroy(self.handle)


def measure(n: int, k: int, m: int, device: torch.device, limit: int) -> dict:
    """cuBLAS (`F.linear`) and every cuBLASLt algorithm of the heuristic's list for x [m, K] @ W^T, W [N, K]."""
    weights = weight_copies(n, k, device)
    x = (torch.randn(m, k, device=device) * 0.5).to(torch.bfloat16)
    ref = F.linear(x.float(), weights[0].float())
    row: dict = {"cublas_us": dense.replay_us(lambda w: F.linear(x, w), weights, device), "algorithms": []}
    gemm = None
    try:
        gemm = LtGemm(n, k, m, limit, device)
        for index in range(len(gemm.algorithms)):
            entry: dict = {"index": index, "workspace": int(gemm.algorithms["workspace_size"][index]),
                           "waves": float(gemm.algorithms["waves_count"][index])}
            try:
                got = gemm.run(x, weights[0], index)
                torch.cuda.synchronize(device)
                entry["max_rel_err"] = ((got.float() - ref).abs().max() / ref.abs().max()).item()
                entry["us"] = dense.replay_us(lambda w, index=index: gemm.run(x, w, index), weights, device)
            except Exception as error:  # an algorithm that fails (or cannot be captured) must not cost the table
                entry["error"] = f"{type(error).__name__}: {str(error)[:160]}"
            row["algorithms"].append(entry)
    except Exception as error:
        row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
    finally:
        if gemm is not None:
            gemm.close()
    timed = [a for a in row["algorithms"] if "us" in a and a["max_rel_err"] < 1e-2]
    best = min(timed, key=lambda a: a["us"]) if timed else None
    row["best"] = best
    row["failed"] = sum("error" in a for a in row["algorithms"])
    row["off"] = sum("us" in a and a["max_rel_err"] >= 1e-2 for a in row["algorithms"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=[m for m in QWEN_MODELS if m != "tiny"],
                        help="repeatable (default next-16b and dense-9b)")
    parser.add_argument("--rows", default="16,32,64")
    parser.add_argument("--limit", type=int, default=64, help="the most algorithms the heuristic returns")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cublaslt_sweep.py needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    rows = [int(r) for r in args.rows.split(",")]
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "cublaslt_sweep.json"
    results: list[dict] = []
    for name in args.model or ["next-16b", "dense-9b"]:
        print(f"\n{name}: device us per GEMM (CUDA-graph replays over weights past L2)")
        print(f"{'linear':<34} {'N x K':>13} {'x/step':>6} {'rows':>4} {'cuBLAS':>8} {'best Lt':>8} {'algo':>4} "
              f"{'ran':>4} {'failed':>6} {'off':>4}", flush=True)
        totals = {m: {"cublas": 0.0, "best": 0.0, "floor": 0.0} for m in rows}
        for what, n, k, count in step_linears(name):
            for m in rows:
                row = {"model": name, "what": what, "n": n, "k": k, "count": count, "rows": m,
                       **measure(n, k, m, device, args.limit)}
                results.append(row)
                path.write_text(json.dumps(results, indent=1))
                best = row["best"]
                best_us = best["us"] if best else float("nan")
                totals[m]["cublas"] += count * row["cublas_us"]
                totals[m]["best"] += count * min(row["cublas_us"], best_us if best else row["cublas_us"])
                totals[m]["floor"] += count * 2 * n * k / COPY_RATE * 1e6
                print(f"{what:<34} {f'{n} x {k}':>13} {count:>6} {m:>4} {row['cublas_us']:>8.2f} {best_us:>8.2f} "
                      f"{best['index'] if best else '-':>4} {len(row['algorithms']):>4} {row['failed']:>6} "
                      f"{row['off']:>4}" + (f"  {row['error']}" if "error" in row else ""), flush=True)
                torch.cuda.empty_cache()
        for m, t in totals.items():
            print(f"{name}, one decode step's dense GEMMs at {m} rows: cuBLAS {t['cublas']:.0f} us, the best of "
                  f"cuBLAS and cuBLASLt per shape {t['best']:.0f} us, floor {t['floor']:.0f} us")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
