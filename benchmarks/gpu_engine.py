"""The engine with the CUDA kernel backend (or the reference backend on the CPU): cached vs uncached greedy agreement.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/gpu_engine.py [--model-dir DIR] [--requests 64]
        [--max-tokens 160] [--dtypes bfloat16,float32] [--device cuda] [--out DIR]

Model: by default a random Qwen3-Next folder with realistic head shapes (`MODEL`: DeltaNet Dk = Dv = 128,
attention head dim 128, MoE with a shared expert; hidden 512, 5 layers, byte vocabulary); `--model-dir` takes
another folder, e.g. the byte LM `benchmarks/train_byte_lm.py` trains on the repository's prose. Prompt text:
uniform random bytes, or, for a folder holding `training_corpus.txt` (a trained one), slices of that corpus at
random offsets (in-distribution text).

Workload, run once without and once with prefix caching on fresh engines: round 1 sends --requests prompts at
once, each one of 8 shared system prompts (100-300 tokens) plus a user message; round 2 continues every
conversation (its round-1 prompt, the reply that engine produced, a new user message). Then the tests'
multi-turn workload (test_cache_equivalence.py) once, its text drawn the same way. Greedy tokens are compared
completion by completion: a completion agrees up to its first differing token (after that the two runs continue
from different text, so nothing later counts as agreeing).

Why they diverge: at every compared step (both runs had the same text so far; a later turn of a conversation
that diverged earlier has another prompt in each run and is left out here) the uncached run's top-1 minus top-2
logit margin, and the largest difference between the two runs' logits; at each divergence both runs'
margins and whether the other run's token is within this run's top 2 / top 5 (vLLM's tests accept a greedy
mismatch as a near-tie by that criterion).

bf16 first (--requests x --max-tokens), then fp32 (--fp32-requests x --fp32-max-tokens: 16 x 64 by default;
the fp32 MoE on CUDA goes through torch's slower grouped-GEMM fallback), where the runs must agree exactly.
Writes DIR/gpu_engine.json (DIR: $OUT, else .).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections.abc import Callable
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
CORPUS_FILE = "training_corpus.txt"  # written by benchmarks/train_byte_lm.py
MARGIN_QUANTILES = (0.01, 0.05, 0.1, 0.5, 0.9, 0.99)

Draw = Callable[[random.Random, int], list[int]]  # (rng, n) -> n token ids


def random_bytes(rng: random.Random, n: int) -> list[int]:
    """n uniform random byte ids."""
    return [rng.randrange(256) for _ in range(n)]


def corpus_slices(corpus: bytes) -> Draw:
    """Draws n consecutive corpus bytes from a random offset (the corpus must be longer than any n drawn)."""
    def draw(rng: random.Random, n: int) -> list[int]:
        if n >= len(corpus):
            raise ValueError(f"cannot draw {n} bytes from a corpus of {len(corpus)}")
        start = rng.randrange(len(corpus) - n)
        return list(corpus[start:start + n])
    return draw


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


def compared_logits(cached, uncached, out_cached: dict, out_uncached: dict) -> dict:
    """The two runs' logits at every compared step of every completion, stacked (see `margins`).

    A completion's step k (its k-th token, sampled with prompt + k tokens) is compared while both runs had the
    same text: k up to its first differing token, that one included, in completions whose prompts are the same
    (a later turn of a conversation that diverged earlier has another prompt in each run: not compared). Returns
    {"cached", "uncached": [S, vocab] fp32, "diverged": [S] bool (the step where the tokens differ),
    "other_prompt": completions left out for their prompts}.
    """
    rows_cached, rows_uncached, diverged = [], [], []
    other_prompt = 0
    for request_id, want_output in out_uncached.items():
        if out_cached[request_id].prompt_token_ids != want_output.prompt_token_ids:
            other_prompt += len(want_output.outputs)
            continue
        prompt_len = len(want_output.prompt_token_ids)
        for got, want in zip(out_cached[request_id].outputs, want_output.outputs, strict=True):
            for k, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=True)):
                key = (request_id, want.index, prompt_len + k)
                rows_cached.append(cached.logits[key])
                rows_uncached.append(uncached.logits[key])
                diverged.append(a != b)
                if a != b:
                    break
    return {"cached": torch.stack(rows_cached).float(), "uncached": torch.stack(rows_uncached).float(),
            "diverged": torch.tensor(diverged, device=rows_cached[0].device), "other_prompt": other_prompt}


def margins(logits: dict) -> dict:
    """Margin statistics of `compared_logits`: why greedy choices flip.

    margin = top-1 minus top-2 logit of the uncached run at a step (0: an exact tie); `rel` variants divide by
    that step's logit standard deviation. diff = max |cached - uncached| logit at a step: what the other chunking
    moved. At divergences: both runs' margins, and in how many the cached run's token is within the uncached run's
    top 2 / top 5 and vice versa (near-ties by vLLM's criterion).
    """
    cached, uncached, diverged = logits["cached"], logits["uncached"], logits["diverged"]
    top = uncached.topk(2, dim=-1).values
    margin = top[:, 0] - top[:, 1]
    rel = margin / uncached.std(dim=-1)
    diff = (cached - uncached).abs().amax(dim=-1)

    def quantiles(x: torch.Tensor) -> dict:
        if x.numel() == 0:
            return {}
        q = torch.quantile(x.double().cpu(), torch.tensor(MARGIN_QUANTILES, dtype=torch.float64))
        return {f"p{round(p * 100)}": round(float(v), 5) for p, v in zip(MARGIN_QUANTILES, q, strict=True)}

    def rank_of(tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """1-based rank of tokens[i] in rows[i] (ties count the better rank)."""
        return (rows > rows.gather(1, tokens[:, None])).sum(dim=1) + 1

    at = diverged.nonzero().flatten()
    token_cached, token_uncached = cached[at].argmax(dim=-1), uncached[at].argmax(dim=-1)
    rank_in_uncached = rank_of(token_cached, uncached[at])
    rank_in_cached = rank_of(token_uncached, cached[at])
    top_cached = cached[at].topk(2, dim=-1).values
    return {
        "steps": len(margin), "divergences": len(at), "completions_other_prompt": logits["other_prompt"],
        "flip_rate": len(at) / max(1, len(margin)),
        "exact_ties": int((margin == 0).sum()),
        "margin_all": quantiles(margin), "margin_all_rel": quantiles(rel), "diff_all": quantiles(diff),
        "margin_diverged_uncached": [round(float(x), 5) for x in margin[at]],
        "margin_diverged_cached": [round(float(x), 5) for x in top_cached[:, 0] - top_cached[:, 1]],
        "margin_diverged_rel": [round(float(x), 5) for x in rel[at]],
        "diff_diverged": [round(float(x), 5) for x in diff[at]],
        "near_tie_top2": int(((rank_in_uncached <= 2) & (rank_in_cached <= 2)).sum()),
        "near_tie_top5": int(((rank_in_uncached <= 5) & (rank_in_cached <= 5)).sum()),
    }


def shared_prefix_workload(engine, seed: int, num: int, max_tokens: int, draw: Draw = random_bytes) -> dict:
    """Two rounds of `num` concurrent conversations over 8 shared system prompts; {request_id: output}."""
    rng = random.Random(seed)
    systems = [draw(rng, rng.randrange(100, 300)) for _ in range(8)]
    prompts = {f"r0-{i}": systems[i % 8] + draw(rng, rng.randrange(5, 50)) for i in range(num)}
    users = [draw(rng, rng.randrange(5, 30)) for _ in range(num)]
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


def run(folder: Path, dtype: str, num: int, max_tokens: int, device: str = "cuda", draw: Draw = random_bytes) -> dict:
    start = time.perf_counter()
    # Two engines live in this process. The budget is utilization x device memory minus what is already in use,
    # so the first takes 45% of the device and the second (default 90%) what is left up to 90%.
    first = {"gpu_memory_utilization": 0.45} if device.startswith("cuda") else {}
    options = {"device": device, "dtype": dtype, "max_num_batched_tokens": 2048, "max_num_seqs": num}
    uncached = make_engine(folder, caching=False, block_size=64, kernel_block_size=64, **options, **first)
    cached = make_engine(folder, block_size=64, kernel_block_size=64, **options)
    out_cached = shared_prefix_workload(cached, 0, num, max_tokens, draw)
    out_uncached = shared_prefix_workload(uncached, 0, num, max_tokens, draw)
    out_cached.update(run_workload(cached, seed=1, draw=draw))
    out_uncached.update(run_workload(uncached, seed=1, draw=draw))
    totals = compare(out_cached, out_uncached)
    totals["agreement"] = totals["agree"] / max(1, totals["total"])
    totals["why"] = margins(compared_logits(cached, uncached, out_cached, out_uncached))
    totals["hit_tokens"] = cached.stats()["cache"].num_hit_tokens
    totals["prefill_tokens"] = {"cached": cached.num_prefill_tokens, "uncached": uncached.num_prefill_tokens}
    totals["seconds"] = time.perf_counter() - start
    return totals


def summary(dtype: str, r: dict) -> str:
    why = r["why"]

    def spread(values: list[float]) -> str:
        return f"median {sorted(values)[len(values) // 2]:.4g}, max {max(values):.4g}" if values else "-"

    return (f"{dtype}: {r['agree']}/{r['total']} greedy tokens agree ({r['agreement']:.4%}), {r['diverged']} "
            f"completions diverged (first differing token at {sorted(r['first_divergence'])}); flips at "
            f"{why['divergences']} of {why['steps']} compared steps ({why['flip_rate']:.3%}; "
            f"{why['completions_other_prompt']} completions not compared: their prompts differ), "
            f"{why['exact_ties']} exact ties. Top-1 minus top-2 logit: all steps {why['margin_all']}, "
            f"/ logit std {why['margin_all_rel']}; at divergences {spread(why['margin_diverged_uncached'])}, "
            f"/ std {spread(why['margin_diverged_rel'])}. Max logit difference between the runs: all steps "
            f"{why['diff_all']}, at divergences {spread(why['diff_diverged'])}. Near-ties: {why['near_tie_top2']} "
            f"(top 2), {why['near_tie_top5']} (top 5) of {why['divergences']}. {r['hit_tokens']} cached prompt "
            f"tokens, prefill {r['prefill_tokens']}, {r['seconds']:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="a model folder (default: a random one of shape MODEL)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--fp32-requests", type=int, default=16)
    parser.add_argument("--fp32-max-tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated, run in this order")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (the reference backend)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    runs = {"bfloat16": (args.requests, args.max_tokens), "float32": (args.fp32_requests, args.fp32_max_tokens)}
    dtypes = args.dtypes.split(",")
    if unknown := [d for d in dtypes if d not in runs]:
        parser.error(f"--dtypes: unknown {unknown}; known: {sorted(runs)}")
    if args.model_dir is not None and not (args.model_dir / "config.json").is_file():
        parser.error(f"--model-dir {args.model_dir}: no config.json there (write one with train_byte_lm.py --out)")
    folder = args.model_dir or write_tiny_model(Path(tempfile.mkdtemp()), "qwen3_next", **MODEL)
    corpus_path = folder / CORPUS_FILE
    draw = corpus_slices(corpus_path.read_bytes()) if corpus_path.is_file() else random_bytes
    from hybridcache.kernels.backend import get_backend

    device = torch.device(args.device)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "model": str(args.model_dir) if args.model_dir else MODEL,
              "prompts": "corpus slices" if draw is not random_bytes else "random bytes",
              "backend": type(get_backend(device)).__name__}
    if (folder / "training.json").is_file():
        training = json.loads((folder / "training.json").read_text())
        result["training"] = {key: training[key] for key in ("corpus", "options", "held_out_loss")}
    print(result, flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for dtype in dtypes:
        num, max_tokens = runs[dtype]
        result[dtype] = run(folder, dtype, num, max_tokens, args.device, draw)
        (Path(args.out) / "gpu_engine.json").write_text(json.dumps(result, indent=1))
        print(summary(dtype, result[dtype]), flush=True)


if __name__ == "__main__":
    main()
