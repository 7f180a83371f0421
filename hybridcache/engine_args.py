"""Command-line options of `EngineConfig`, shared by every subcommand that runs a model.

It lives next to the config (not in `cli.py`) so that `cli.py` and the subcommand modules it loads
(`server/cli.py`, `bench/cli.py`) both import it from below and never each other.
"""

from __future__ import annotations

import argparse
import sys

from hybridcache.config import CACHE_MODES, DTYPES, EVICTION_POLICIES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine options (`--model` and the `EngineConfig` fields) to a subcommand's parser."""
    parser.add_argument("--model", default=None, help="model folder (default: the built-in model)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--kernel-block-size", type=int, default=None)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    parser.add_argument(
        "--cache-mode", default="hybridcache", choices=list(CACHE_MODES),
        help="where state checkpoints are saved (see docs/design.md)",
    )
    parser.add_argument("--num-checkpoint-slots", type=int, default=None, metavar="SLOTS",
                        help="state slots for prefix-cache checkpoints (default: 32 on the CPU, from the memory "
                        "budget on CUDA)")
    parser.add_argument("--state-cache-budget", type=int, default=None, metavar="SLOTS",
                        help="deprecated alias of --num-checkpoint-slots")
    parser.add_argument("--decode-checkpoint-interval", type=int, default=None)
    parser.add_argument("--eviction", default="lru", choices=list(EVICTION_POLICIES))
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                        help="CUDA: fraction of the device memory for weights, activations and the cache "
                        "(default 0.9)")
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: never capture CUDA graphs")


def engine_options(args: argparse.Namespace) -> dict:
    """The `EngineConfig` keyword arguments of parsed engine options.

    `--state-cache-budget` sets `num_checkpoint_slots` with a warning on stderr; given together with a
    different `--num-checkpoint-slots` it is a ValueError (the command line says two things)."""
    slots = args.num_checkpoint_slots
    if args.state_cache_budget is not None:
        print("hybridcache: warning: --state-cache-budget is deprecated, use --num-checkpoint-slots", file=sys.stderr)
        if slots is not None and slots != args.state_cache_budget:
            raise ValueError(
                f"--state-cache-budget {args.state_cache_budget} and --num-checkpoint-slots {slots} disagree"
            )
        slots = args.state_cache_budget
    options = dict(
        block_size=args.block_size,
        kernel_block_size=args.kernel_block_size,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_cache,
        cache_mode=args.cache_mode,
        decode_checkpoint_interval=args.decode_checkpoint_interval,
        eviction=args.eviction,
        dtype=args.dtype,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
    )
    if slots is not None:
        options["num_checkpoint_slots"] = slots
    return options
