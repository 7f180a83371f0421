"""The `hybridcache` command line: generate (offline), serve (OpenAI-compatible HTTP), simulate (the cache
simulator) and bench (the engine benchmark)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import import_module
from importlib.util import find_spec

# Subcommands that live with their feature: each module has `register(subparsers)`.
_SUBCOMMAND_MODULES = ("hybridcache.server.cli", "hybridcache.bench.cli")

DEFAULT_PROMPTS = (
    "The quick brown fox",
    "A hybrid model keeps a recurrent state that",
    "Prefix caching for hybrid models needs",
    "Once upon a time",
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by every subcommand that runs a model."""
    parser.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--kernel-block-size", type=int, default=None)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    parser.add_argument(
        "--cache-mode", default="hybridcache", choices=["hybridcache", "seed", "block-aligned", "none"],
        help="where state checkpoints are saved (see docs/design.md)",
    )
    parser.add_argument("--num-checkpoint-slots", type=int, default=32, help="state slots for checkpoints")
    parser.add_argument("--decode-checkpoint-interval", type=int, default=None)
    parser.add_argument("--eviction", default="lru", choices=["lru", "flop_aware"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")


def engine_options(args: argparse.Namespace) -> dict:
    return dict(
        block_size=args.block_size,
        kernel_block_size=args.kernel_block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_cache,
        cache_mode=args.cache_mode,
        num_checkpoint_slots=args.num_checkpoint_slots,
        decode_checkpoint_interval=args.decode_checkpoint_interval,
        eviction=args.eviction,
        dtype=args.dtype,
        device=args.device,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from hybridcache import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=args.seed, n=args.n, ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    llm = LLM(args.model, **engine_options(args))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for output in outputs:
        for completion in output.outputs:
            record = {
                "prompt": output.prompt, "completion": completion.index, "text": completion.text,
                "num_tokens": len(completion.token_ids), "finish_reason": completion.finish_reason,
                "cached_tokens": output.cached_tokens,
            }
            print(json.dumps(record, ensure_ascii=False))
    engine = llm.engine
    print(
        f"# {len(outputs)} prompts, {engine.num_prefill_tokens} prefill + {engine.num_decode_tokens} decode "
        f"tokens in {elapsed:.2f} s",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridcache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts (offline)")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable; default: a few demo prompts)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("-n", type=int, default=1)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=cmd_generate)
    for name in _SUBCOMMAND_MODULES:
        if find_spec(name.rsplit(".", 1)[0]) is not None and find_spec(name) is not None:
            import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as error:  # bad input, missing files, an unreachable server
        print(f"hybridcache: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
