"""Command-line options of `EngineConfig`, shared by every subcommand that runs a model, and the resolution of
`dtype="auto"` / `device="auto"` / `mamba_ssm_cache_dtype="auto"` that both the command line and `LLM` use.

It lives next to the config (not in `cli.py`) so that `cli.py` and the subcommand modules it loads
(`server/cli.py`, `bench/cli.py`) both import it from below and never each other.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from hybridcache.arg_types import (
    human_readable_int,
    json_object,
    model_len,
    non_negative_float,
    non_negative_int,
    positive_float,
)
from hybridcache.config import (
    CACHE_MODES,
    DTYPE_ALIASES,
    DTYPES,
    EVICTION_ALIASES,
    EVICTION_POLICIES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    SSM_DTYPE_FLAG,
    EngineConfig,
)

AUTO = "auto"
_logger = logging.getLogger("hybridcache.engine_args")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help already says what the default is or the flag is
    required."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if "default" in help_text.lower() or action.default is argparse.SUPPRESS or action.required:
            return help_text
        return super()._get_help_string(action)


@dataclass(frozen=True)
class VllmOption:
    """A vLLM engine option (an `LLM(...)` keyword and a `--flag`) with no `EngineConfig` field: `verdict(value)`
    says what it does here for a value given (not None): a one-line note that is logged (it has no effect here), or
    None (nothing to say), or raises ValueError naming the option (what cannot be done here). `flag`: argparse
    keywords of its `--flag` (its default is None: not given); `aliases`: its other option strings (vLLM's)."""

    name: str
    help: str
    verdict: Callable[[object], str | None]
    flag: dict
    aliases: tuple[str, ...] = ()


def _no_effect(why: str) -> Callable[[object], str | None]:
    return lambda value: why


def _refused_unless(accepted: Callable[[object], bool], why: str) -> Callable[[object], str | None]:
    def verdict(value: object) -> None:
        if not accepted(value):
            raise ValueError(why.format(value=value))
    return verdict


def _chunked_prefill(value: object) -> str | None:
    if value is False:
        raise ValueError("enable_chunked_prefill=False (--no-enable-chunked-prefill): prefill is always chunked here "
                         "(at most max_num_batched_tokens tokens a step) and cannot be turned off")
    return "enable_chunked_prefill: prefill is always chunked here (max_num_batched_tokens a step)"


def _as_number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# The vLLM options without a field of their own, in one table read by `add_engine_args` (the flags) and
# `resolve_engine_config` (`LLM`'s keywords and the parsed flags). `seed`, `tokenizer`, and vLLM's dtype names
# ("half", "float") are `EngineConfig`'s own; `revision` and `download_dir` choose the model folder: the command
# line (`model_options`) and `LLM` pass them to `resolve_model`.
VLLM_OPTIONS: tuple[VllmOption, ...] = (
    VllmOption("trust_remote_code", "accepted, a no-op: no model code is loaded from the checkpoint",
               _no_effect("trust_remote_code has no effect: hybridcache runs its own implementation of the model and "
                          "loads only weights and configuration from the checkpoint"),
               dict(action="store_true", default=None)),
    VllmOption("swap_space", "accepted, ignored (as vLLM V1 ignores it): the host tier is --host-cache-gib",
               _no_effect("swap_space is ignored (vLLM V1 ignores it too); the host tier behind the cache is "
                          "host_cache_gib (--host-cache-gib / --kv-offloading-size)"),
               dict(type=non_negative_float, metavar="GIB")),
    VllmOption("disable_log_stats", "serve: write no stats lines; elsewhere accepted, a no-op (nothing logs stats)",
               _no_effect("disable_log_stats: offline generation writes no stats lines"),
               dict(action="store_true", default=None)),
    VllmOption("enable_chunked_prefill", "accepted when on: prefill is always chunked; --no-enable-chunked-prefill "
               "is refused", _chunked_prefill, dict(action=argparse.BooleanOptionalAction)),
    VllmOption("tokenizer_mode", "auto or hf (a Hugging Face fast tokenizer, the only kind used); others are refused",
               _refused_unless(lambda v: v in ("auto", "hf"), "tokenizer_mode {value!r} is not supported: the "
                               "tokenizer is always the model folder's Hugging Face tokenizer.json (auto or hf)"),
               dict(metavar="MODE")),
    VllmOption("cpu_offload_gb", "0 only: weights are not offloaded to the CPU",
               _refused_unless(lambda v: _as_number(v) == 0, "cpu_offload_gb {value!r}: offloading weights to the "
                               "CPU is not supported (the KV cache's host tier is --host-cache-gib)"),
               dict(type=float, metavar="GIB")),
    VllmOption("max_logprobs", "20 only: the limit on logprobs and prompt_logprobs per token is fixed at 20",
               _refused_unless(lambda v: _as_number(v) == 20, "max_logprobs {value!r}: the limit on logprobs (and "
                               "prompt_logprobs) is fixed at 20 here, OpenAI's top_logprobs limit; only 20 is "
                               "accepted"),
               dict(type=int, metavar="N")),
    VllmOption("distributed_executor_backend", "mp or uni, a no-op: tensor-parallel ranks are always worker "
               "processes on this machine (vLLM's single-node default, mp); ray and external_launcher are refused",
               _refused_unless(lambda v: v in ("mp", "uni"), "distributed_executor_backend {value!r} is not "
                               "supported: tensor-parallel ranks run as worker processes on this machine (mp)"),
               dict(metavar="BACKEND")),
    VllmOption("enable_expert_parallel", "accepted, a no-op: under tensor parallelism each rank holds its share "
               "of every expert (no expert parallelism; the same tokens)",
               _no_effect("enable_expert_parallel has no effect: under tensor parallelism each rank holds its share "
                          "of every expert (there is no expert parallelism here); the outputs are the same"),
               dict(action="store_true", default=None)),
    VllmOption("optimization_level", "vLLM's -O0 ... -O3, accepted, a no-op: there is no torch.compile here (CUDA "
               "graphs: --enforce-eager)",
               _no_effect("optimization_level (-O) has no effect: hybridcache does not use torch.compile; its CUDA "
                          "graphs are its own (--enforce-eager turns them off)"),
               dict(type=int, choices=range(4), metavar="LEVEL"), aliases=("-O",)),
    VllmOption("compilation_config", "a JSON object, accepted, a no-op: there is no torch.compile here (CUDA graphs: "
               "--enforce-eager)",
               _no_effect("compilation_config has no effect: hybridcache does not use torch.compile; its CUDA graphs "
                          "are its own (--enforce-eager turns them off)"),
               dict(type=json_object, metavar="JSON")),
    VllmOption("max_cudagraph_capture_size", "accepted, a no-op: CUDA graphs are captured for the batch sizes "
               "--max-num-seqs allows",
               _no_effect("max_cudagraph_capture_size has no effect: CUDA graphs are captured for the batch sizes "
                          "max_num_seqs allows"),
               dict(type=non_negative_int, metavar="N")),
    VllmOption("mm_encoder_tp_mode", "weights or data, accepted, a no-op: under tensor parallelism the vision "
               "encoder runs as hybridcache runs it, whichever is named (the same outputs)",
               _no_effect("mm_encoder_tp_mode has no effect: under tensor parallelism the vision encoder runs as "
                          "hybridcache runs it, whichever mode is named; the outputs are the same"),
               dict(choices=("weights", "data"), metavar="MODE")),
    VllmOption("mm_processor_cache_type", "lru or shm, accepted, a no-op: processed images are not cached across "
               "requests here",
               _no_effect("mm_processor_cache_type has no effect: processed images are not cached across requests "
                          "here"),
               dict(choices=("lru", "shm"), metavar="TYPE")),
    VllmOption("mamba_cache_dtype", "auto or float32 / bfloat16 / float16: as vLLM's, the recurrent (ssm) state's "
               "dtype where --mamba-ssm-cache-dtype is auto; the conv state stays in the model dtype here",
               _refused_unless(lambda v: v in (AUTO, *DTYPES), "mamba_cache_dtype {value!r} must be one of "
                               + ", ".join((AUTO, *DTYPES))),
               dict(metavar="DTYPE")),
    VllmOption("hf_overrides", "a JSON object of config.json items to use instead of the folder's (nested objects "
               "merged), as vLLM's", lambda value: None, dict(type=json_object, metavar="JSON")),
    VllmOption("revision", "the model's revision on the Hugging Face hub (a branch, tag or commit) when MODEL is a "
               "hub id (default: main)", lambda value: None, dict(metavar="REV")),
    VllmOption("download_dir", "the Hugging Face cache folder a hub id is read from and downloaded into (default: "
               "$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)", lambda value: None,
               dict(metavar="DIR")),
)
_VLLM_OPTIONS = {option.name: option for option in VLLM_OPTIONS}
# The options that choose the model folder, given to `resolve_model`.
MODEL_OPTIONS = ("revision", "download_dir", "hf_overrides")


def _eviction(value: str) -> str:
    """`--eviction`'s type: the old underscore spelling is accepted and means the same policy."""
    return EVICTION_ALIASES.get(value, value)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the model (positional MODEL or `--model`) and the `EngineConfig` options to a subcommand's parser."""
    model_help = ("a model folder, a Hugging Face snapshot folder, or a hub id (org/name): from the local "
                  "Hugging Face cache, downloaded into it when missing unless HF_HUB_OFFLINE=1")
    parser.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                        help=f"{model_help} (default: the built-in model)")
    parser.add_argument("--model", default=None, help="the same as MODEL (give one of the two; default: MODEL)")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per KV block (the unit of sharing)")
    parser.add_argument("--kernel-block-size", type=int, default=None,
                        help="tokens per kernel page, a power of two dividing --block-size (default: the "
                             "largest such power of two up to 64)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="blocks in the one pool of KV and prefix-cache checkpoint states (a state takes k "
                             "blocks); default: on the CPU twice what --max-num-seqs full sequences need plus 32 "
                             "states, on CUDA the rest of the memory budget")
    parser.add_argument("--host-cache-gib", "--kv-offloading-size", type=non_negative_float, default=0.0, metavar="GIB",
                        help="a host-memory tier behind the pool, GiB (vLLM's --kv-offloading-size): device "
                             "eviction moves blocks and checkpoint states there, a hit copies them back "
                             "(default: 0, none)")
    parser.add_argument("--hicache-size", type=non_negative_float, default=None, metavar="GB",
                        help="the host tier in GB (10^9 bytes; SGLang's spelling); overrides --host-cache-gib")
    parser.add_argument("--disk-cache-dir", default=None, metavar="DIR",
                        help="a disk tier behind the host tier: what falls out of the host tier is written under "
                             "DIR (per model) and a restarted engine on the same model finds it (needs "
                             "--host-cache-gib; default: none)")
    parser.add_argument("--disk-cache-gib", type=positive_float, default=64.0, metavar="GIB",
                        help="the disk tier's cap on its files, GiB (default: 64)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="sequences running at once")
    parser.add_argument("--max-num-batched-tokens", type=human_readable_int, default=512,
                        help="token budget of one step (8k = 8,000, 8K = 8,192, as vLLM)")
    parser.add_argument("--max-model-len", type=model_len, default=None,
                        help="prompt + completion limit (32k = 32,000, 32K = 32,768, as vLLM; default and auto: the "
                             "model's; on the CPU at most 8192)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse computed prefixes across requests")
    parser.add_argument("--no-prefix-cache", dest="enable_prefix_caching", action="store_false",
                        help="alias of --no-enable-prefix-caching (default: not given)")
    parser.add_argument("--cache-mode", default="hybridcache", choices=list(CACHE_MODES),
                        help="where state checkpoints are saved (see docs/design.md)")
    parser.add_argument("--decode-checkpoint-interval", type=int, default=None,
                        help="also save a checkpoint every this many decoded tokens, a multiple of --block-size "
                             "(default: off)")
    parser.add_argument("--stream-interval", type=int, default=1, metavar="N",
                        help="a streamed request's output goes out at its first token, then every N tokens and at its "
                             "end, as vLLM's: fewer, larger chunks, less host work with many streams (default: 1)")
    parser.add_argument("--eviction", default="lru", type=_eviction, choices=list(EVICTION_POLICIES),
                        help="prefix-cache eviction policy (flop_aware is accepted for flop-aware)")
    parser.add_argument("--dtype", default=AUTO, choices=[AUTO, *DTYPES, *DTYPE_ALIASES],
                        help="weights and activations (half = float16, float = float32, as vLLM); auto: float32 on "
                             "CPU, on CUDA the model's torch_dtype when it is bfloat16 or float16, else bfloat16 "
                             "(default: auto)")
    parser.add_argument(SSM_DTYPE_FLAG, default=AUTO, choices=[AUTO, *DTYPES],
                        help="the recurrent ssm state (gated DeltaNet, KDA, Mamba2 or Mamba1) in the state slots; "
                             "auto: --mamba-cache-dtype when it names a dtype, else the model config's mamba_ssm_dtype "
                             "when it has one, else float32. bfloat16 halves the state (about "
                             "twice the checkpoint states per GiB) but cached and uncached runs then differ by "
                             "bf16 rounding (default: auto)")
    parser.add_argument("--device", default=AUTO,
                        help="cpu, cuda or cuda:N; auto: cuda when a GPU is present, else cpu (default: auto)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                        help="CUDA: fraction of the device memory for this engine's weights, activations and "
                             "cache, whatever other processes hold (default: 0.9)")
    parser.add_argument("--enforce-eager", action="store_true", help="CUDA: never capture CUDA graphs")
    parser.add_argument("--attention-backend", default=None,
                        help="attention kernels by registered name: reference or triton (CUDA) (default: triton on "
                             "CUDA with the CUDA kernels installed, else reference)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="plan the next step while the device runs this one (default: on for CUDA without "
                             "tensor parallelism)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split the model over this many devices (one worker process each)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding with the model\'s MTP head, as vLLM: '
                             '\'{"method": "mtp", "num_speculative_tokens": 2}\' ("qwen3_next_mtp" also accepted)')
    parser.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATIONS),
                        help="quantise a dense checkpoint's linears at load (fp8: 128 x 128 block-scaled e4m3); an "
                             "FP8 checkpoint (Qwen's fine-grained FP8, compressed-tensors) loads as it is without "
                             "it (default: none)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="the attention KV pool's dtype; fp8 (e4m3, per-layer k/v scales from the checkpoint, "
                             "else 1.0) halves its bytes (default: auto, the model dtype)")
    parser.add_argument("--load-format", default="auto", choices=list(LOAD_FORMATS),
                        help="auto: read the safetensors; dummy: random weights drawn on the device (benchmarks; "
                             "the folder needs only config.json and the tokenizer)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the engine's seed, as vLLM's: a request without its own seed samples from the engine's "
                             "next draw from it, so the same requests in the same order give the same tokens")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="a folder (or hub id) with the tokenizer to use instead of the model's (default: the "
                             "model folder's)")
    vllm = parser.add_argument_group("other vLLM engine options")
    for option in VLLM_OPTIONS:
        shown = option.help if "default" in option.help else f"{option.help} (default: not given)"
        vllm.add_argument("--" + option.name.replace("_", "-"), *option.aliases, help=shown,
                          **{"default": None, **option.flag})


def model_argument(args: argparse.Namespace) -> str | None:
    """The model the command line names: MODEL or `--model` (a ValueError when both name different ones)."""
    positional, flag = args.model_arg, args.model
    if positional is not None and flag is not None and positional != flag:
        raise ValueError(f"the model is given twice: MODEL {positional!r} and --model {flag!r}")
    return positional if positional is not None else flag


def engine_options(args: argparse.Namespace) -> dict:
    """The `EngineConfig` keyword arguments of parsed engine options (`dtype`/`device` may be "auto": pass them
    through `resolve_engine_config`)."""
    return dict(
        block_size=args.block_size,
        kernel_block_size=args.kernel_block_size,
        num_blocks=args.num_blocks,
        host_cache_gib=args.host_cache_gib if args.hicache_size is None else args.hicache_size * 1e9 / (1 << 30),
        disk_cache_dir=args.disk_cache_dir,
        disk_cache_gib=args.disk_cache_gib,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        cache_mode=args.cache_mode,
        decode_checkpoint_interval=args.decode_checkpoint_interval,
        stream_interval=args.stream_interval,
        eviction=args.eviction,
        dtype=args.dtype,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        load_format=args.load_format,
        attention_backend=args.attention_backend,
        speculative_config=args.speculative_config,
        seed=args.seed,
        tokenizer=args.tokenizer,
        **{option.name: getattr(args, option.name) for option in VLLM_OPTIONS if option.name not in MODEL_OPTIONS},
    )


def model_options(args: argparse.Namespace) -> dict:
    """The `resolve_model` keywords of parsed engine options (`--revision`, `--download-dir`, `--hf-overrides`)."""
    return {name: getattr(args, name) for name in MODEL_OPTIONS}


def auto_device() -> str:
    """"cuda" when torch sees a GPU, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def auto_dtype(device: str, model_torch_dtype: str) -> str:
    """The dtype `auto` means: float32 on CPU; on CUDA the model's own `torch_dtype` when it is a half type,
    else bfloat16 (a float32 checkpoint runs in bfloat16 on a GPU).

    >>> auto_dtype("cpu", "bfloat16"), auto_dtype("cuda:1", "float16"), auto_dtype("cuda", "float32")
    ('float32', 'float16', 'bfloat16')
    """
    if not device.startswith("cuda"):
        return "float32"
    return model_torch_dtype if model_torch_dtype in ("bfloat16", "float16") else "bfloat16"


def auto_ssm_dtype(model_ssm_dtype: str | None) -> str:
    """The recurrent state dtype `auto` means: the model config's `mamba_ssm_dtype` when it names one (what vLLM
    does for Qwen3.5, whose checkpoints say float32), else float32 on every device (vLLM falls back to the
    model dtype instead; transformers and flash-linear-attention keep the state in fp32, and only fp32 keeps
    cached and uncached runs equal). A config naming a dtype we cannot store is a ValueError.

    >>> auto_ssm_dtype(None), auto_ssm_dtype("bfloat16")
    ('float32', 'bfloat16')
    """
    if model_ssm_dtype is None:
        return "float32"
    if model_ssm_dtype not in DTYPES:
        raise ValueError(f"the model's config.json sets mamba_ssm_dtype {model_ssm_dtype!r}, which is not supported: "
                         f"pass {SSM_DTYPE_FLAG} {' or '.join(DTYPES)}")
    return model_ssm_dtype


def _take_vllm_options(options: dict) -> None:
    """Remove the `VLLM_OPTIONS` from `options`, logging the note of each one given (not None) and raising the
    ValueError of one that cannot be done; a keyword that is neither an `EngineConfig` field nor a vLLM option is a
    TypeError naming it as `LLM`'s (the command line passes only known ones)."""
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(options) - known - set(_VLLM_OPTIONS))
    if unknown:
        raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r} (engine options: the fields of "
                        f"EngineConfig and vLLM's {', '.join(_VLLM_OPTIONS)})")
    for name in [name for name in options if name in _VLLM_OPTIONS]:
        value = options.pop(name)
        if value is None:
            continue
        note = _VLLM_OPTIONS[name].verdict(value)
        if note:  # a warning: an option the user gave does nothing here (`generate` shows no INFO lines)
            _logger.warning("%s", note)


def resolve_engine_config(model_dir: str | Path, options: dict) -> EngineConfig:
    """`EngineConfig(**options)` with `device="auto"`, `dtype="auto"` and `mamba_ssm_cache_dtype="auto"`
    replaced by what they mean for the model in `model_dir` on this machine (see `auto_device`, `auto_dtype`,
    `auto_ssm_dtype`), vLLM's options without a field (`VLLM_OPTIONS`) taken out (each logged as a no-op or refused),
    and `tokenizer` resolved to a folder. Raises ValueError for a bad option before anything is loaded; an explicit
    state dtype other than the one the model's config names is allowed, with a warning (as vLLM does)."""
    options = dict(options)
    cache_dtype = options.get("mamba_cache_dtype")
    _take_vllm_options(options)
    if cache_dtype in DTYPES and options.get("mamba_ssm_cache_dtype", AUTO) == AUTO:  # vLLM's: the ssm state follows
        options["mamba_ssm_cache_dtype"] = cache_dtype                                 # mamba_cache_dtype
    if options.get("tokenizer") is not None:
        options["tokenizer"] = str(_tokenizer_folder(options["tokenizer"]))
    ssm_given = "mamba_ssm_cache_dtype" in options
    ssm_dtype = options.get("mamba_ssm_cache_dtype")
    if ssm_given and ssm_dtype not in (AUTO, *DTYPES):
        raise ValueError(f"mamba_ssm_cache_dtype ({SSM_DTYPE_FLAG}) must be one of {', '.join((AUTO, *DTYPES))}, "
                         f"got {ssm_dtype!r}")
    if options.get("device") == AUTO:
        options["device"] = auto_device()
    if options.get("dtype") == AUTO or ssm_given:
        from hybridcache.models import ModelConfig

        model_config = ModelConfig.from_model_dir(model_dir)
        if options.get("dtype") == AUTO:
            device = str(options.get("device", EngineConfig.device))
            options["dtype"] = auto_dtype(device, model_config.torch_dtype)
        if ssm_dtype == AUTO:
            options["mamba_ssm_cache_dtype"] = auto_ssm_dtype(model_config.mamba_ssm_dtype)
        elif model_config.mamba_ssm_dtype is not None and ssm_dtype != model_config.mamba_ssm_dtype:
            _logger.warning("the model's config.json sets mamba_ssm_dtype %s; %s %s overrides it",
                            model_config.mamba_ssm_dtype, SSM_DTYPE_FLAG, ssm_dtype)
    return EngineConfig(**options)


def _tokenizer_folder(name: object) -> Path:
    """The folder `tokenizer=` names: a folder a tokenizer loads from (as a model folder's: tokenizer.json, or a
    tokenizer_config.json whose class converts its own vocabulary files), or a hub id (resolved as a model is,
    without weights). A ValueError naming it otherwise."""
    from hybridcache.model_path import resolve_model

    if not isinstance(name, (str, Path)):
        raise ValueError(f"tokenizer must be a folder or a hub id, got {name!r}")
    path = Path(name).expanduser()
    if not path.is_dir() and not path.exists() and not str(name).startswith((".", "/", "~")):
        path = resolve_model(str(name), weights=False).path
    if not any((path / file).is_file() for file in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"tokenizer {str(name)!r}: no tokenizer.json (nor tokenizer_config.json) in {path}")
    return path
