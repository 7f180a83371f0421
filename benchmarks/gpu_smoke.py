"""The engine on a CUDA device: cached vs uncached equivalence and a throughput figure, in one run.

    PYTHONPATH=. python benchmarks/gpu_smoke.py [--device cuda] [--json results/gpu_smoke.json]

Runs the tests' randomized multi-turn workload (tests/engine/test_cache_equivalence.py) on tiny random
Qwen3.5 and Qwen3-Next folders with the pools, the copy kernels (Triton) and the torch reference layers on
the device, and checks that the cached run gives the uncached run's greedy tokens and logits within 1e-4
(fp32). Then times the built-in model's prefill and decode there.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from hybridcache.sampling import SamplingParams
from tests.engine.model_folders import write_tiny_model
from tests.engine.test_cache_equivalence import assert_same, make_engine, run_workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default="results/gpu_smoke.json")
    args = parser.parse_args()
    result: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device}
    for model_type in ("qwen3_5_text", "qwen3_next"):
        folder = write_tiny_model(Path(tempfile.mkdtemp()), model_type)
        uncached = make_engine(folder, caching=False, device=args.device)
        cached = make_engine(folder, device=args.device)
        start = time.perf_counter()
        out_uncached = run_workload(uncached)
        out_cached = run_workload(cached, check_every_step=True)
        assert_same(cached, uncached, out_cached, out_uncached)
        hits = sum(o.num_cached_tokens for o in out_cached.values())
        result[model_type] = {"equivalent": True, "hit_tokens": hits, "seconds": time.perf_counter() - start}
        print(f"{model_type}: cached == uncached on {args.device}, {hits} hit tokens")
    from hybridcache import LLM

    llm = LLM(device=args.device, max_num_seqs=32, max_num_batched_tokens=8192)
    prompts = torch.randint(0, 256, (32, 256), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    for max_tokens in (1, 65):
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        result[f"builtin_seconds_max_tokens_{max_tokens}"] = time.perf_counter() - start
    decode = result["builtin_seconds_max_tokens_65"] - result["builtin_seconds_max_tokens_1"]
    result["builtin_prefill_tokens_per_s"] = 32 * 256 / result["builtin_seconds_max_tokens_1"]
    result["builtin_decode_tokens_per_s"] = 32 * 64 / decode
    print(json.dumps(result, indent=2))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
