"""The engine on CUDA with the CUDA kernel backend: cached vs uncached greedy agreement, bf16 and fp32.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/gpu_engine.py [--requests 64] [--max-tokens 160] [--out DIR]

Model: a random Qwen3-Next folder with realistic head shapes (DeltaNet Dk = Dv = 128, attention head dim 128,
MoE with a shared expert; hidden 512, 5 layers, byte vocabulary). Workload, run once without and once with
prefix caching on fresh engines: round 1 sends --requests prompts at once, each one of 8 shared system prompts
(100-300 tokens) plus a user message; round 2 continues every conversation (its round-1 prompt, the reply that
engine produced, a new user message). Then the tests' multi-turn workload (test_cache_equivalence.py) once.
Greedy tokens are compared completion by completion: a completion agrees up to its first differing token (after
that the two runs continue from different text, so nothing later counts as agreeing). bf16 first, then fp32,
where they must agree exactly (16 conversations of 64 tokens: the fp32 MoE goes through torch's slower
grouped-GEMM fallback). Writes DIR/gpu_engine.json (DIR: $OUT, else .).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from hybridcache.sampling import SamplingParams
from tests.engine.model_folders import write_tiny_model
from tests.engine.test_cache_equivalence import make_engine, run_workload

MODEL = {
    "hidden_size": 512, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
    "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256, "intermediate_size": 512,
}


def compare(out_cached: dict, out_uncached: dict) -> dict:
    """Tokens that agree (common prefix per completion), total tokens, completions that diverged and where."""
    agree = total = diverged = 0
    first_divergence = []
    for request_id, want_output in out_uncached.items():
        for got, want in zip(out_cached[request_id].outputs, want_output.outputs, strict=True):
            got, want = list(got.token_ids), list(want.token_ids)
            prefix = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(want))
            agree += prefix
            total += len(want)
            if prefix < len(want):
                diverged += 1
                first_divergence.append(prefix)
    return {"agree": agree, "total": total, "diverged": diverged, "first_divergence": first_divergence}


def shared_prefix_workload(engine, seed: int, num: int, max_tokens: int) -> dict:
    """Two rounds of `num` concurrent conversations over 8 shared system prompts; {request_id: output}."""
    rng = random.Random(seed)
    systems = [[rng.randrange(256) for _ in range(rng.randrange(100, 300))] for _ in range(8)]
    prompts = {f"r0-{i}": systems[i % 8] + [rng.randrange(256) for _ in range(rng.randrange(5, 50))]
               for i in range(num)}
    users = [[rng.randrange(256) for _ in range(rng.randrange(5, 30))] for _ in range(num)]
    results = {}
    for round_ in range(2):
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                  ignore_eos=True))
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    results[output.request_id] = output
        if round_ == 0:
            prompts = {f"r1-{i}": prompts[f"r0-{i}"] + list(results[f"r0-{i}"].outputs[0].token_ids) + users[i]
                       for i in range(num)}
    return results


def run(folder: Path, dtype: str, num: int, max_tokens: int, device: str = "cuda") -> dict:
    start = time.perf_counter()
    # Two engines live in this process. The budget is utilization x device memory minus what is already in use,
    # so the first takes 45% of the device and the second (default 90%) what is left up to 90%.
    first = {"gpu_memory_utilization": 0.45} if device.startswith("cuda") else {}
    options = {"device": device, "dtype": dtype, "max_num_batched_tokens": 2048, "max_num_seqs": num}
    uncached = make_engine(folder, caching=False, block_size=64, kernel_block_size=64, **options, **first)
    cached = make_engine(folder, block_size=64, kernel_block_size=64, **options)
    shared = compare(shared_prefix_workload(cached, 0, num, max_tokens),
                     shared_prefix_workload(uncached, 0, num, max_tokens))
    out_cached, out_uncached = run_workload(cached, seed=1), run_workload(uncached, seed=1)
    turns = compare(out_cached, out_uncached)
    totals = {key: shared[key] + turns[key] for key in ("agree", "total", "diverged", "first_divergence")}
    totals["agreement"] = totals["agree"] / max(1, totals["total"])
    totals["hit_tokens"] = cached.stats()["cache"].num_hit_tokens
    totals["prefill_tokens"] = {"cached": cached.num_prefill_tokens, "uncached": uncached.num_prefill_tokens}
    totals["seconds"] = time.perf_counter() - start
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated, run in this order")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    folder = write_tiny_model(Path(tempfile.mkdtemp()), "qwen3_next", **MODEL)
    from hybridcache.kernels.backend import get_backend

    result = {"device": torch.cuda.get_device_name(), "model": MODEL,
              "backend": type(get_backend(torch.device("cuda"))).__name__}
    print(result, flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    runs = {"bfloat16": (args.requests, args.max_tokens), "float32": (16, 64)}
    for dtype in args.dtypes.split(","):
        num, max_tokens = runs[dtype]
        result[dtype] = run(folder, dtype, num, max_tokens)
        (Path(args.out) / "gpu_engine.json").write_text(json.dumps(result, indent=1))
        r = result[dtype]
        print(f"{dtype}: {r['agree']}/{r['total']} greedy tokens agree ({r['agreement']:.4%}), {r['diverged']} "
              f"completions diverged (first differing token at {sorted(r['first_divergence'])}); "
              f"{r['hit_tokens']} cached prompt tokens, prefill {r['prefill_tokens']}, {r['seconds']:.0f} s",
              flush=True)


if __name__ == "__main__":
    main()
