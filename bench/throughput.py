"""Prefill and decode throughput of hybridcache next to transformers, on the same model and tokens.

    .venv/bin/python bench/throughput.py [--model DIR] [--num-prompts 8] [--prompt-len 512] [--decode-len 64]

Both engines run greedy on the same random prompts of equal length (so transformers needs no padding) in
one process, alternating, `--repeats` times each; the best time of each is kept (the machine is shared and
noisy). Prefill time is the time to produce the first token; decode time is the rest. The table gives
tokens/s and the ratio, and whether the generated tokens agree (transformers' `generate` is known to drift
from its own full forward on these hybrid classes after the first token, so disagreement there is expected;
the tests check our tokens against transformers' full forward instead). Results: results/throughput.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hybridcache import LLM, SamplingParams


def time_hybridcache(llm: LLM, prompts: list[list[int]], decode_len: int) -> tuple[float, float, list]:
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=decode_len + 1, ignore_eos=True)
    llm.generate(prompts[:1], first, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, first, use_tqdm=False)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    outputs = llm.generate(prompts, full, use_tqdm=False)
    total = time.perf_counter() - start
    return prefill, total - prefill, [o.outputs[0].token_ids for o in outputs]


@torch.inference_mode()
def time_transformers(model_dir: Path, prompts: list[list[int]], decode_len: int) -> tuple[float, float, list]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    model.generate(input_ids[:1], max_new_tokens=1, min_new_tokens=1, **kwargs)  # warm-up
    start = time.perf_counter()
    model.generate(input_ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(input_ids, max_new_tokens=decode_len + 1, min_new_tokens=decode_len + 1, **kwargs)
    total = time.perf_counter() - start
    return prefill, total - prefill, out[:, input_ids.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="results/throughput.json")
    args = parser.parse_args()

    # Prefix caching off: every run recomputes the same prompts, and raw compute is what is measured here.
    llm = LLM(
        args.model, max_num_batched_tokens=args.num_prompts * args.prompt_len, max_num_seqs=args.num_prompts,
        enable_prefix_caching=False,
    )
    vocab = llm.engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, min(vocab, 256), (args.num_prompts, args.prompt_len), generator=generator).tolist()
    num_prefill = args.num_prompts * args.prompt_len
    num_decode = args.num_prompts * args.decode_len
    rows = {}
    runs: dict[str, list] = {"hybridcache": [], "transformers": []}
    for _ in range(args.repeats):
        runs["hybridcache"].append(time_hybridcache(llm, prompts, args.decode_len))
        runs["transformers"].append(time_transformers(llm.engine.model_path, prompts, args.decode_len))
    ours, theirs = (
        (min(r[0] for r in runs[k]), min(r[1] for r in runs[k]), runs[k][0][2]) for k in ("hybridcache", "transformers")
    )
    for name, (prefill, decode, _) in (("hybridcache", ours), ("transformers", theirs)):
        rows[name] = {"prefill_tokens_per_s": num_prefill / prefill, "decode_tokens_per_s": num_decode / decode}
    same = sum(a == b for a, b in zip(ours[2], theirs[2]))
    print(f"{'engine':<14}{'prefill tok/s':>16}{'decode tok/s':>16}")
    for name, row in rows.items():
        print(f"{name:<14}{row['prefill_tokens_per_s']:>16.1f}{row['decode_tokens_per_s']:>16.1f}")
    ratio = {k: rows["hybridcache"][k] / rows["transformers"][k] for k in rows["hybridcache"]}
    print(f"{'ratio':<14}{ratio['prefill_tokens_per_s']:>16.2f}{ratio['decode_tokens_per_s']:>16.2f}")
    print(f"greedy outputs identical for {same}/{len(prompts)} prompts")
    result = {
        "num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "decode_len": args.decode_len,
        "engines": rows, "ratio": ratio, "identical_outputs": same, "threads": torch.get_num_threads(),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
