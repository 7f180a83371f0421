"""Prefill and decode throughput of hybridcache next to transformers, on the same model and tokens.

    .venv/bin/python benchmarks/throughput.py [--model DIR] [--num-prompts 8] [--prompt-len 512] [--decode-len 64]

Both engines run greedy on the same random prompts of equal length (so transformers needs no padding) in
one process, alternating, `--repeats` times each; the best time of each is kept (the machine is shared and
noisy). Prefill time is the time until every prompt has its first token (one batched forward); decode time
is the rest (one token per sequence per step). transformers runs its model directly with its own cache and
explicit positions (its `generate` drifts from its own full forward on these hybrid classes). The table
gives tokens/s, the ratio, and for how many prompts the greedy tokens agree. Results:
results/throughput.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hybridcache import LLM, SamplingParams


def time_hybridcache(llm: LLM, prompts: list[list[int]], decode_len: int, tag: str) -> tuple[float, float, list]:
    """Prefill seconds (until every prompt has its first token), decode seconds (the rest), tokens."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=decode_len + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    started, tokens = set(), {}
    start = time.perf_counter()
    while len(started) < len(prompts):
        started.update(o.request_id for o in engine.step())
    prefill = time.perf_counter() - start
    while engine.has_unfinished_requests():
        tokens.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    decode = time.perf_counter() - start - prefill
    return prefill, decode, [tokens[f"{tag}-{i}"] for i in range(len(prompts))]


@torch.inference_mode()
def time_transformers(model, prompts: list[list[int]], decode_len: int) -> tuple[float, float, list]:
    """The same split for transformers: one batched forward over the prompts, then one token at a time with
    its cache (positions passed explicitly on every call)."""
    from transformers import DynamicCache

    input_ids = torch.tensor(prompts)
    num, length = input_ids.shape
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    logits = model(input_ids, position_ids=torch.arange(length)[None].expand(num, -1), cache=cache,
                   use_cache=True, logits_to_keep=1).logits
    token = logits[:, -1].argmax(-1)
    prefill = time.perf_counter() - start
    out = [token]
    for step in range(decode_len):
        position = torch.full((num, 1), length + step)
        logits = model(token[:, None], position_ids=position, cache=cache, use_cache=True).logits
        token = logits[:, -1].argmax(-1)
        out.append(token)
    decode = time.perf_counter() - start - prefill
    return prefill, decode, torch.stack(out, dim=1).tolist()


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
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=torch.float32).eval()
    time_hybridcache(llm, prompts[:1], 2, "warm-up")
    time_transformers(hf_model, prompts[:1], 2)
    runs: dict[str, list] = {"hybridcache": [], "transformers": []}
    for repeat in range(args.repeats):
        runs["hybridcache"].append(time_hybridcache(llm, prompts, args.decode_len, f"run{repeat}"))
        runs["transformers"].append(time_transformers(hf_model, prompts, args.decode_len))
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
