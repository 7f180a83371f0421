"""The `hybridcache` command line: generate (offline), serve (OpenAI-compatible HTTP), simulate (the cache
simulator) and bench (the engine benchmark). vLLM's other spellings of the flags (`--max_model_len`,
`--speculative-config.method mtp`, `--config FILE`) are rewritten before argparse reads them (vllm_argv.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from importlib import import_module
from importlib.util import find_spec

from hybridcache.engine_args import HelpFormatter, add_engine_args, engine_options, model_argument, model_options
from hybridcache.extras import MissingExtra
from hybridcache.generation_config import add_generation_config_arg
from hybridcache.vllm_argv import vllm_argv

# Subcommands that live with their feature: each module has `register(subparsers)`.
_SUBCOMMAND_MODULES = ("hybridcache.server.cli", "hybridcache.bench.cli", "hybridcache.router.cli")

DEFAULT_PROMPTS = (
    "The quick brown fox",
    "A hybrid model keeps a recurrent state that",
    "Prefix caching for hybrid models needs",
    "Once upon a time",
)


def cmd_generate(args: argparse.Namespace) -> int:
    from hybridcache import LLM

    model, hub = model_argument(args), model_options(args)
    if any(value is not None for value in hub.values()):  # LLM takes no revision: resolve the model folder here
        from hybridcache.model_path import resolve_model

        model = resolve_model(model, **hub).path
    # closed at the end: a disk tier (--disk-cache-dir) is handed what the cache holds, so a rerun hits it
    with LLM(model, generation_config=args.generation_config, **engine_options(args)) as llm:
        return _generate(llm, args)


def _generate(llm, args: argparse.Namespace) -> int:
    """Sample the command's prompts with `llm` and print one JSON line per completion, then a summary line."""
    from hybridcache import SamplingParams

    defaults = llm.sampling_defaults  # what a flag left unset takes, before the command's own defaults
    params = SamplingParams(
        temperature=defaults.pick("temperature", args.temperature, 0.0),
        top_p=defaults.pick("top_p", args.top_p, 1.0), top_k=defaults.pick("top_k", args.top_k, 0),
        min_p=defaults.pick("min_p", None, 0.0), repetition_penalty=defaults.pick("repetition_penalty", None, 1.0),
        max_tokens=defaults.pick("max_tokens", args.max_tokens, 32), n=args.n,
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for output in outputs:
        for completion in output.outputs:
            record = {
                "prompt": output.prompt, "completion": completion.index, "text": completion.text,
                "num_tokens": len(completion.token_ids), "finish_reason": completion.finish_reason,
                "cached_tokens": output.num_cached_tokens,
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
    parser = argparse.ArgumentParser(prog="hybridcache", description=__doc__, allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts (offline)", description=(
        "Generate completions for prompts with one engine, and print one JSON line per completion."),
        formatter_class=HelpFormatter, allow_abbrev=False)
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable; default: a few demo prompts)")
    from_file = "default: the model's generation_config.json (see --generation-config), else"
    gen.add_argument("--max-tokens", type=int, default=None,
                     help=f"new tokens per completion at most ({from_file} 32)")
    gen.add_argument("--temperature", type=float, default=None, help=f"0 is greedy ({from_file} 0)")
    gen.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling, 1.0 is off ({from_file} 1.0)")
    gen.add_argument("--top-k", type=int, default=None, help=f"top-k sampling, 0 is off ({from_file} 0)")
    add_generation_config_arg(gen)
    gen.add_argument("-n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    gen.set_defaults(func=cmd_generate)
    for name in _SUBCOMMAND_MODULES:
        if find_spec(name.rsplit(".", 1)[0]) is not None and find_spec(name) is not None:
            import_module(name).register(sub)
    for command in sub.choices.values():  # read by `vllm_argv` before argparse: shown in --help only
        command.add_argument("--config", default=None, metavar="YAML",
                             help="a YAML file of long flag names and values, as vLLM's (`max-model-len: 4096`); "
                                  "the command line's flags win (default: none)")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed command line (`sys.argv[1:]` by default) after `vllm_argv`; `args.argv` is the command line
    argparse took (`serve --data-parallel-size` gives it to its replicas)."""
    parser = build_parser()
    argv = vllm_argv(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as error:  # a bad --config file
        print(f"hybridcache: error: {error}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (ValueError, OSError, MissingExtra) as error:  # bad input, missing files, an unreachable server
        print(f"hybridcache: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
