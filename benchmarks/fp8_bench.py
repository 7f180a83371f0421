"""FP8 on the H200 (issue 29): gpu_bench's phases with FP8 weights beside bf16 in one call, the Qwen3-Next-80B-A3B
shape in FP8 on one GPU, and the KV pool with FP8 KV.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/fp8_bench.py [--runs next-16b:bf16,next-16b:fp8,80b:fp8]
        [--phases C,D,A] [--kv-pools] [--gpu-memory-utilization F] [--out DIR] [--model-dir DIR] [--scale S]

A run is MODEL:WEIGHTS. MODEL is a `gpu_bench.MODELS` name (its random bf16 folder is built once, in --model-dir
or a temporary folder, and shared by its bf16 and FP8 runs) or `80b`; WEIGHTS is `bf16`, `fp8` (128 x 128
block-scaled, quantised at load: `quantization="fp8"`) or `fp8-channel` (the folder written in compressed-tensors'
per-channel format by `write_fp8_folder`, on the disk next to the bf16 one). `80b` is the Qwen3-Next-80B-A3B shape
(48 layers 3:1, hidden 2048, 512 experts top-10 + a shared expert, expert width 512, vocabulary 151,936): about
80 GB in FP8, more than the machine's disk, so its folder holds only config.json and the tokenizer and the engine
draws its weights on the GPU (`load_format="dummy"`, FP8 linears quantised from their draws); in bf16 (~160 GB) it
does not fit one H200 and is not run.

Each run builds one engine (async scheduling and CUDA graphs as gpu_bench), records its start-up seconds, the
memory plan (blocks, the blocks of one checkpoint state, how many checkpoint states the pool holds), then warms up
and runs the phases (gpu_bench's A, C, D: D records the decode step in ms), then frees the GPU before the next run.
`--kv-pools` adds, per model, the pool's blocks under one fixed budget for bf16 and FP8 KV (computed from the state
specs, no engine: FP8 KV runs on the reference backend only until the Triton attention reads it).

Prints a side-by-side table and writes DIR/fp8_bench.json (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks import gpu_bench
from hybridcache import LLM
from hybridcache.models.builtin import build_byte_tokenizer

QWEN3_NEXT_80B = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
                      num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                      linear_key_head_dim=128, linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10,
                      moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=5120)
WEIGHTS = ("bf16", "fp8", "fp8-channel")


def config_only_folder(path: Path) -> Path:
    """The 80B shape's folder: config.json (bf16, byte tokenizer's eos) and the byte tokenizer, no weights."""
    import transformers

    config = transformers.Qwen3NextConfig(**QWEN3_NEXT_80B, eos_token_id=258, dtype="bfloat16")
    config.architectures = ["Qwen3NextForCausalLM"]
    path.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(path / "config.json"))
    build_byte_tokenizer().save(str(path / "tokenizer.json"))
    return path


def run_folder(model: str, weights: str, root: Path) -> tuple[Path, dict]:
    """(the folder, the extra LLM options) of one run."""
    if model == "80b":
        if weights != "fp8":
            raise ValueError("the 80B shape runs in fp8 only (bf16 does not fit one H200; no folder for channel)")
        return config_only_folder(root / "80b"), {"load_format": "dummy", "quantization": "fp8"}
    dense = gpu_bench.model_folder(model, str(root / model))
    if weights == "bf16":
        return dense, {}
    if weights == "fp8":
        return dense, {"quantization": "fp8"}
    channel = root / f"{model}-fp8-channel"
    if not (channel / "config.json").is_file():
        from hybridcache.models.fp8_folders import write_fp8_folder

        write_fp8_folder(dense, channel, "channel")
    return channel, {}


def one_run(model: str, weights: str, root: Path, phases: list[str], options: dict) -> dict:
    folder, extra = run_folder(model, weights, root)
    cuda = options["device"] == "cuda"
    start = time.perf_counter()
    llm = LLM(folder, **options, **extra)
    result: dict = {"model": model, "weights": weights, "engine_init_s": time.perf_counter() - start,
                    "weight_format": llm.engine.weight_format, "memory": llm.engine.memory_plan.describe(),
                    "num_blocks": llm.engine.memory_plan.num_blocks, "state_pages": llm.engine.memory_plan.state_pages,
                    "cuda_graphs": list(llm.engine.runner.graph_batch_sizes), "phases": {},
                    "gpu_memory_allocated_gib": torch.cuda.memory_allocated() / 2**30 if cuda else None}
    result["checkpoint_states_that_fit"] = result["num_blocks"] // max(1, result["state_pages"])
    print(f"{model}:{weights} up in {result['engine_init_s']:.1f} s: {result['memory']}", flush=True)
    gpu_bench.warm_up(llm, random.Random(99))
    runners = {"A": gpu_bench.phase_a, "B": gpu_bench.phase_b, "C": gpu_bench.phase_c, "D": gpu_bench.phase_d}
    rng = random.Random(0)
    for phase in phases:
        before = gpu_bench.cache_counts(llm)
        try:
            result["phases"][phase] = runners[phase](llm, rng)
        except Exception as error:  # one broken phase must not cost the others' figures
            traceback.print_exc()
            result.setdefault("errors", {})[phase] = repr(error)
            continue
        result["phases"][phase]["cache"] = {name: dict(counts - before[name])
                                            for name, counts in gpu_bench.cache_counts(llm).items()}
        gpu_bench.print_row(f"{model}:{weights} {phase}", result["phases"][phase])
    del llm
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def kv_pools(model: str, root: Path, budget_gib: float) -> dict:
    """The pool's blocks and checkpoint states under a fixed budget with the model-dtype (bf16) and FP8 KV."""
    from hybridcache.engine.memory import pool_bytes, state_pages
    from hybridcache.models import ModelConfig, get_model_class, quant

    folder = config_only_folder(root / "80b") if model == "80b" else gpu_bench.model_folder(model, str(root / model))
    config = ModelConfig.from_model_dir(folder)
    with torch.device("meta"):
        net = get_model_class(config.architecture)(config)
    out = {"budget_gib": budget_gib}
    for kv in ("bf16", "fp8"):
        quant.set_kv_fp8(net, kv == "fp8", {})
        block, slot = pool_bytes(net.state_specs(torch.bfloat16, torch.float32), 64, net.slot_specs(torch.bfloat16))
        blocks = int(budget_gib * 2**30 // block)
        out[kv] = {"kv_bytes_per_block": block, "state_bytes": slot, "blocks": blocks,
                   "state_pages": state_pages(slot, block), "tokens_of_kv": blocks * 64}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="next-16b:bf16,next-16b:fp8,80b:fp8")
    parser.add_argument("--phases", default="C,D,A")
    parser.add_argument("--kv-pools", action="store_true")
    parser.add_argument("--kv-budget-gib", type=float, default=40.0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--model-dir", default=None, help="folders are built (or reused) under this folder")
    parser.add_argument("--out", default=None)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every workload length (smoke tests)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (--runs tiny:fp8 ...)")
    args = parser.parse_args()
    gpu_bench.SCALE["value"] = args.scale
    root = Path(args.model_dir) if args.model_dir else Path(tempfile.mkdtemp())
    out_path = Path(args.out or os.environ.get("OUT") or ".") / "fp8_bench.json"
    runs = [tuple(r.split(":")) for r in args.runs.split(",") if r]
    bad = [r for r in runs if len(r) != 2 or r[1] not in WEIGHTS or (r[0] not in gpu_bench.MODELS and r[0] != "80b")]
    if bad:
        parser.error(f"runs must be MODEL:WEIGHTS with MODEL in {[*gpu_bench.MODELS, '80b']}, WEIGHTS in {WEIGHTS}")
    phases = [p.strip().upper() for p in args.phases.split(",") if p.strip()]
    options = dict(dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device, block_size=64,
                   max_num_seqs=64,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   gpu_memory_utilization=args.gpu_memory_utilization)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    result: dict = {"device": device_name, "date": time.strftime("%Y-%m-%d"), "runs": []}
    for model, weights in runs:
        try:
            result["runs"].append(one_run(model, weights, root, phases, options))
        except Exception as error:
            traceback.print_exc()
            result["runs"].append({"model": model, "weights": weights, "error": repr(error)})
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1))
    if args.kv_pools:
        result["kv_pools"] = {model: kv_pools(model, root, args.kv_budget_gib) for model in dict(runs)}
        print(json.dumps(result["kv_pools"], indent=1))
        out_path.write_text(json.dumps(result, indent=1))
    print("| run | init s | blocks | states | phase | hit rate | p50 ms | total s | out tok/s | decode step ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in result["runs"]:
        for phase, r in run.get("phases", {}).items():
            tok_s = f"{r['output_tok_per_s']:.0f}" if "output_tok_per_s" in r else "-"
            step = f"{r['decode_step_ms_p50']:.1f}" if r.get("decode_step_ms_p50") else "-"
            print(f"| {run['model']}:{run['weights']} | {run['engine_init_s']:.0f} | {run['num_blocks']:,} | "
                  f"{run['checkpoint_states_that_fit']:,} | {phase} | {r['hit_rate']:.3f} | {r['p50_ms']:.0f} | "
                  f"{r['total_s']:.2f} | {tok_s} | {step} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
